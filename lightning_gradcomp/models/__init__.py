"""The papers' models as plain ``nn.Module``s (NOTES.md §1.4, §2.4, §3.4, §4.2)."""

from lightning_gradcomp.models.alexnet import AlexNet
from lightning_gradcomp.models.char_lstm import CharLSTM
from lightning_gradcomp.models.cifarnet import Cifar10CNN, CifarNet
from lightning_gradcomp.models.googlenet import GoogLeNet
from lightning_gradcomp.models.gpt import GPT
from lightning_gradcomp.models.lenet import LeNet, MnistCNN
from lightning_gradcomp.models.mlp import BN50DNN, MLP
from lightning_gradcomp.models.resnet import ResNet, ResNet18, ResNet50
from lightning_gradcomp.models.seq2seq import Seq2SeqAttention
from lightning_gradcomp.models.vgg import VGGA

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
