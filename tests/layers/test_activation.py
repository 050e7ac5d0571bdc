"""Activation names resolve to functions equal to transformers' ACT2FN."""

import pytest
import torch
from transformers.activations import ACT2FN

from pagedserve.layers.activation import ACTIVATIONS, get_activation


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_activation_matches_transformers(name):
    x = torch.linspace(-6, 6, 101)
    torch.testing.assert_close(get_activation(name)(x), ACT2FN[name](x), rtol=1e-6, atol=1e-6)


def test_unknown_activation():
    with pytest.raises(ValueError, match="supported"):
        get_activation("nope")
