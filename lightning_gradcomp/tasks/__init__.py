"""LightningModules the recipes train: classification, character LM, sequence-to-sequence."""

from lightning_gradcomp.tasks.base import TrainingTask, l2_penalty, regularized_parameters
from lightning_gradcomp.tasks.classification import ImageClassifier
from lightning_gradcomp.tasks.language_model import CharLanguageModel
from lightning_gradcomp.tasks.seq2seq import Seq2SeqTask

__all__ = ["CharLanguageModel", "ImageClassifier", "Seq2SeqTask", "TrainingTask", "l2_penalty", "regularized_parameters"]
