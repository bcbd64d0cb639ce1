"""The papers' models: output shapes on tiny inputs, parameter counts the papers imply, TF-style layers."""

import math
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradcomp_lab.models import (
    BN50DNN,
    MLP,
    VGGA,
    AlexNet,
    CharLSTM,
    Cifar10CNN,
    CifarNet,
    GoogLeNet,
    LeNet,
    MnistCNN,
    ResNet18,
    ResNet50,
    Seq2SeqAttention,
)
from gradcomp_lab.models.layers import SameMaxPool2d, WithinChannelLRN, tf_lrn
from gradcomp_lab.tasks import regularized_parameters


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


CASES = [
    (lambda: LeNet(), (2, 1, 28, 28), 10),
    (lambda: LeNet(padding="valid", init="caffe"), (2, 1, 28, 28), 10),
    (lambda: LeNet(image_size=8, num_classes=5), (2, 1, 8, 8), 5),
    (lambda: MnistCNN(), (2, 1, 28, 28), 10),
    (lambda: LeNet(conv_relu=False, init="torch"), (2, 1, 28, 28), 10),
    (lambda: CifarNet(), (2, 3, 24, 24), 10),
    (lambda: Cifar10CNN(), (2, 3, 32, 32), 10),
    (lambda: AlexNet(num_classes=7, dropout=0.2), (2, 3, 67, 67), 7),
    (lambda: AlexNet(num_classes=7, batch_norm=False, groups=1, init="torch"), (2, 3, 67, 67), 7),
    (lambda: GoogLeNet(num_classes=7, dropout=0.08), (2, 3, 32, 32), 7),
    (lambda: GoogLeNet(num_classes=7, slim=False), (2, 3, 32, 32), 7),
    (lambda: VGGA(num_classes=10, image_size=32, classifier_width=64), (2, 3, 32, 32), 10),
    (lambda: VGGA(num_classes=10, image_size=32, classifier_width=64, batch_norm=True), (2, 3, 32, 32), 10),
    (lambda: ResNet18(num_classes=7), (2, 3, 32, 32), 7),
    (lambda: ResNet18(num_classes=10, cifar_stem=True), (2, 3, 8, 8), 10),
    (lambda: ResNet50(num_classes=7, zero_init_residual=True), (2, 3, 32, 32), 7),
    (lambda: MLP(hidden_dim=32), (2, 1, 28, 28), 10),
    (lambda: BN50DNN(hidden_dim=16, num_classes=30), (2, 440), 30),
]


@pytest.mark.parametrize("index", range(len(CASES)))
def test_forward_shape_and_backward(index: int) -> None:
    build, shape, classes = CASES[index]
    model = build()
    out = model(torch.randn(shape))
    assert out.shape == (shape[0], classes) and torch.isfinite(out).all()
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_char_lstm_and_seq2seq_shapes() -> None:
    lstm = CharLSTM(vocab_size=11, hidden_size=16)
    assert lstm(torch.randint(0, 11, (3, 7))).shape == (3, 7, 11)
    assert CharLSTM(vocab_size=11, hidden_size=16, embedding_dim=5)(torch.randint(0, 11, (3, 7))).shape == (3, 7, 11)
    model = Seq2SeqAttention(20, 30, embedding_dim=8, hidden_size=12, num_layers=2)
    src = torch.randint(4, 20, (3, 6))
    assert model(src, torch.tensor([6, 4, 2]), torch.randint(4, 30, (3, 5))).shape == (3, 5, 30)
    decoded = model.greedy_decode(src, torch.tensor([6, 6, 6]), max_len=9)
    assert decoded.shape == (3, 9) and decoded.dtype == torch.long


def test_seq2seq_ignores_source_padding() -> None:
    model = Seq2SeqAttention(20, 30, embedding_dim=8, hidden_size=12, dropout=0.0).eval()
    src = torch.randint(4, 20, (1, 4))
    padded = torch.cat([src, torch.zeros(1, 3, dtype=torch.long)], dim=1)
    tgt = torch.randint(4, 30, (1, 5))
    torch.testing.assert_close(model(src, torch.tensor([4]), tgt), model(padded, torch.tensor([4]), tgt))


def test_paper_parameter_counts() -> None:
    same = LeNet()
    # NOTES.md §1.4: with SAME padding fc3 has 7*7*50*500 weights (Caffe VALID: 4*4*50*500)
    assert same.fc3.weight.numel() == 7 * 7 * 50 * 500
    assert LeNet(padding="valid").fc3.weight.numel() == 4 * 4 * 50 * 500
    assert count(same) == 1_256_080
    assert count(MnistCNN()) == 431_080  # AdaComp "1.7 MB" = 431K float32
    assert count(CifarNet()) == 1_068_298
    assert count(Cifar10CNN()) == 89_578  # AdaComp "0.3 MB"
    assert count(CharLSTM(vocab_size=67, hidden_size=512, num_layers=2)) == 3_325_507  # AdaComp "13 MB"
    assert count(BN50DNN()) == 10_798_959  # AdaComp "43 MB"
    with torch.device("meta"):  # ImageNet-size models: count without allocating or initialising
        assert count(MLP()) == 36_818_954  # Aji & Heafield 3x4096
        assert count(ResNet18()) == 11_689_512  # AdaComp "44.6 MB" (MiB)
        assert count(ResNet50()) == 25_557_032  # AdaComp "98 MB"
        assert count(VGGA()) == 132_863_336
        assert count(AlexNet()) == 60_965_224  # BN without scale (inception slim)
        assert count(GoogLeNet()) == 6_617_624  # TF-slim inception_v1 without aux heads, BN without scale
        assert count(GoogLeNet(slim=False)) == 7_005_832


def test_lenet_tf_initialisation() -> None:
    model = LeNet()
    for layer, std in ((model.conv1, 0.05), (model.fc3, 0.048), (model.fc4, 0.0767)):
        w = layer.weight.detach()
        assert float(w.abs().max()) <= 2 * std  # truncated at two standard deviations
        # a normal truncated at +-2 sigma has std 0.8796 sigma
        assert abs(float(w.std()) / (0.8796 * std) - 1) < 0.1
        assert layer.bias is not None
        assert torch.equal(layer.bias.detach(), torch.zeros_like(layer.bias))
    assert {id(p) for p in regularized_parameters(model)} == {id(m.weight) for m in (model.conv1, model.conv2, model.fc3, model.fc4)}
    cifar = CifarNet()
    assert {id(p) for p in regularized_parameters(cifar)} == {id(cifar.fc3.weight), id(cifar.fc4.weight)}
    assert cifar.conv2.bias is not None and cifar.conv1.bias is not None
    assert float(cifar.conv2.bias[0].detach()) == pytest.approx(0.1) and float(cifar.conv1.bias[0].detach()) == 0.0


def test_same_max_pool_matches_tf_padding() -> None:
    x = torch.arange(25.0).view(1, 1, 5, 5)
    # TF SAME, k3 s2 on 5: output 3, total padding 2 split 1/1; on 6: output 3, padding 1 at the end only
    expected5 = F.max_pool2d(F.pad(x, (1, 1, 1, 1), value=-math.inf), 3, 2)
    torch.testing.assert_close(SameMaxPool2d(3, 2)(x), expected5)
    y = torch.arange(36.0).view(1, 1, 6, 6).neg()
    out = SameMaxPool2d(3, 2)(y)
    assert out.shape == (1, 1, 3, 3) and float(out[0, 0, 0, 0]) == 0.0 and float(out[0, 0, 2, 2]) == -28.0


def test_lrn_layers_match_their_formulas() -> None:
    x = torch.rand(2, 12, 4, 4) + 0.5
    r, bias, alpha, beta = 4, 1.0, 0.001 / 9, 0.75
    sq = F.pad(x.pow(2), (0, 0, 0, 0, r, r)).unfold(1, 2 * r + 1, 1).sum(-1)  # sum over channels d-r..d+r
    torch.testing.assert_close(tf_lrn(r, bias, alpha, beta)(x), x / (bias + alpha * sq).pow(beta))
    local = F.pad(x.pow(2), (1, 1, 1, 1)).unfold(2, 3, 1).unfold(3, 3, 1).sum((-1, -2))
    torch.testing.assert_close(WithinChannelLRN(3, 5e-5, 0.75)(x), x / (1 + 5e-5 / 9 * local).pow(0.75))
