"""Print each paper model's parameter count: ``python -m gradcomp_lab.models``.

Models are built on the meta device, so even VGG-A (133M parameters) costs no memory or time.
"""

import torch

from gradcomp_lab import models as m

ROWS = [
    ("LeNet (TernGrad, SAME)", lambda: m.LeNet()),
    ("LeNet (padding=valid)", lambda: m.LeNet(padding="valid")),
    ("MnistCNN (AdaComp)", lambda: m.MnistCNN()),
    ("CifarNet (TernGrad/WeightGrad, 24x24)", lambda: m.CifarNet()),
    ("Cifar10CNN (AdaComp)", lambda: m.Cifar10CNN()),
    ("AlexNet (BN, 2 towers, 1000 classes)", lambda: m.AlexNet()),
    ("GoogLeNet (TF-slim variant, BN, no aux, 1000 classes)", lambda: m.GoogLeNet()),
    ("GoogLeNet (slim=False: 5x5 branches, BN with scale)", lambda: m.GoogLeNet(slim=False)),
    ("VGGA (224x224, 1000 classes)", lambda: m.VGGA()),
    ("VGGA (batch_norm=True, TernGrad's slim model)", lambda: m.VGGA(batch_norm=True)),
    ("VGGA (CIFAR-10: image_size=32, 10 classes)", lambda: m.VGGA(num_classes=10, image_size=32)),
    ("ResNet18 (1000 classes)", lambda: m.ResNet18()),
    ("ResNet50 (1000 classes)", lambda: m.ResNet50()),
    ("MLP (Aji & Heafield, 3x4096)", lambda: m.MLP()),
    ("BN50DNN (AdaComp)", lambda: m.BN50DNN()),
    ("CharLSTM (2x512, vocab 67)", lambda: m.CharLSTM(vocab_size=67)),
    ("CharLSTM (2x512, vocab 65 = Tiny Shakespeare)", lambda: m.CharLSTM(vocab_size=65)),
    ("Seq2SeqAttention (defaults, 10k vocabs)", lambda: m.Seq2SeqAttention()),
]


def table() -> str:
    """A Markdown table of parameter counts and float32 sizes (``docs/data-and-models.md`` shows it, through
    ``tools/results_tables.py``)."""
    lines = ["| Model | Parameters | float32 MiB |", "|---|---:|---:|"]
    for name, build in ROWS:
        with torch.device("meta"):
            n = sum(p.numel() for p in build().parameters())
        lines.append(f"| {name} | {n:,} | {n * 4 / 2**20:.1f} |")
    return "\n".join(lines)


def main() -> None:
    """Print the table of parameter counts and float32 sizes."""
    print(table())


if __name__ == "__main__":
    main()
