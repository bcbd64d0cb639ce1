"""LightningModules the recipes train: classification, character LM, sequence-to-sequence."""

from gradcomp_lab.tasks.base import TrainingTask, l2_penalty, regularized_parameters
from gradcomp_lab.tasks.classification import ImageClassifier
from gradcomp_lab.tasks.language_model import CharLanguageModel
from gradcomp_lab.tasks.seq2seq import Seq2SeqTask

__all__ = ["CharLanguageModel", "ImageClassifier", "Seq2SeqTask", "TrainingTask", "l2_penalty", "regularized_parameters"]
