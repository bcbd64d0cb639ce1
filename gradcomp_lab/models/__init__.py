"""The papers' models as plain ``nn.Module``s (NOTES.md §1.4, §2.4, §3.4, §4.2)."""

from gradcomp_lab.models.alexnet import AlexNet
from gradcomp_lab.models.char_lstm import CharLSTM
from gradcomp_lab.models.cifarnet import Cifar10CNN, CifarNet
from gradcomp_lab.models.googlenet import GoogLeNet
from gradcomp_lab.models.gpt import GPT
from gradcomp_lab.models.lenet import LeNet, MnistCNN
from gradcomp_lab.models.mlp import BN50DNN, MLP
from gradcomp_lab.models.resnet import ResNet, ResNet18, ResNet50
from gradcomp_lab.models.seq2seq import Seq2SeqAttention
from gradcomp_lab.models.vgg import VGGA

__all__ = [
    "BN50DNN",
    "MLP",
    "AlexNet",
    "CharLSTM",
    "Cifar10CNN",
    "CifarNet",
    "GPT",
    "GoogLeNet",
    "LeNet",
    "MnistCNN",
    "ResNet",
    "ResNet18",
    "ResNet50",
    "Seq2SeqAttention",
    "VGGA",
]
