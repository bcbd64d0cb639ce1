"""Fully connected networks: the gradient-dropping MNIST MLP and AdaComp's BN50-shaped speech DNN."""

from typing import Literal

from torch import Tensor, nn

from gradcomp_lab.models.layers import weights
from lightning_gradcomp.validation import check_choice, check_int

_ACTIVATIONS = {"relu": nn.ReLU, "sigmoid": nn.Sigmoid, "tanh": nn.Tanh}


class MLP(nn.Module):
    """``num_hidden_layers`` fc layers of ``hidden_dim`` units, then the logits; inputs are flattened.

    The default is Aji & Heafield's MNIST model (NOTES.md §2.4: 3 hidden layers of "4069", read as 4096;
    36,818,954 parameters). ``layer_norm`` adds LayerNorm after each hidden fc, which the paper needs for a
    global drop threshold on NMT.

    Args:
        input_dim: flattened input size (784 for 28x28).
        hidden_dim: units per hidden layer.
        num_hidden_layers: hidden fc layers.
        num_classes: output logits.
        activation: ``"relu"``, ``"sigmoid"`` or ``"tanh"``.
        layer_norm: LayerNorm after each hidden fc (before the activation).
    """

    def __init__(
        self,
        input_dim: int = 784,
        hidden_dim: int = 4096,
        num_hidden_layers: int = 3,
        num_classes: int = 10,
        activation: Literal["relu", "sigmoid", "tanh"] = "relu",
        layer_norm: bool = False,
    ) -> None:
        super().__init__()
        check_int("input_dim", input_dim, minimum=1)
        check_int("hidden_dim", hidden_dim, minimum=1)
        check_int("num_hidden_layers", num_hidden_layers, minimum=0)
        check_int("num_classes", num_classes, minimum=1)
        check_choice("activation", activation, tuple(_ACTIVATIONS))
        layers: list[nn.Module] = [nn.Flatten()]
        width = input_dim
        for _ in range(num_hidden_layers):
            layers.append(nn.Linear(width, hidden_dim))
            if layer_norm:
                layers.append(nn.LayerNorm(hidden_dim))
            layers.append(_ACTIVATIONS[activation]())
            width = hidden_dim
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def regularized_parameters(self) -> list[nn.Parameter]:
        """The fc weight matrices."""
        return weights(self)


class BN50DNN(MLP):
    """AdaComp's BN50-DNN shape (Table 2: 440x1024, 4x 1024x1024, 1024x5999; 10,798,959 parameters, 43 MB).

    Six fc layers (five sigmoid hidden layers, the usual choice for hybrid DNN-HMM acoustic models; the
    paper does not name the activation). BN50 itself is proprietary: feed any ``input_dim`` features.

    Args:
        input_dim: acoustic feature size (440 = 11 frames x 40).
        hidden_dim: hidden width.
        num_hidden_layers: hidden fc layers.
        num_classes: output states (5999 context-dependent states).
        activation: hidden activation.
        layer_norm: LayerNorm after each hidden fc.
    """

    def __init__(
        self,
        input_dim: int = 440,
        hidden_dim: int = 1024,
        num_hidden_layers: int = 5,
        num_classes: int = 5999,
        activation: Literal["relu", "sigmoid", "tanh"] = "sigmoid",
        layer_norm: bool = False,
    ) -> None:
        super().__init__(input_dim, hidden_dim, num_hidden_layers, num_classes, activation, layer_norm)
