"""GroupedMLP: parameters as documented, forward equal to the functional call, gradients reach them."""

import torch

import moemlp


def test_grouped_mlp_module_matches_functional():
    torch.manual_seed(0)
    m = moemlp.GroupedMLP(num_experts=3, hidden_size=16, ffn_hidden_size=8, activation="geglu", bias=True,
                          scale_fc2_bias=True, glu_interleave=4, dtype=torch.float64, backend="torch")
    assert m.fc1_weight.shape == (3, 16, 16) and m.fc2_weight.shape == (3, 16, 8)
    assert m.fc1_bias.shape == (3, 16) and m.fc2_bias.shape == (3, 16)
    bound = 1 / 16**0.5
    assert 0 < m.fc1_weight.abs().max() <= bound
    with torch.no_grad():
        m.fc1_bias.normal_()
        m.fc2_bias.normal_()
    x = torch.randn(11, 16, dtype=torch.float64)
    splits = torch.tensor([4, 0, 5])
    probs = torch.rand(11, dtype=torch.float64)
    y = m(x, splits, probs)
    y_f = moemlp.grouped_mlp(x, splits, probs, m.fc1_weight, m.fc2_weight, m.fc1_bias, m.fc2_bias,
                             activation="geglu", glu_interleave=4, scale_fc2_bias=True, backend="torch")
    assert torch.equal(y, y_f)
    assert torch.equal(y[9:], torch.zeros_like(y[9:]))  # 2 capacity rows
    y.square().sum().backward()
    for p in m.parameters():
        assert p.grad is not None and p.grad.shape == p.shape
    # Expert 1 has no rows: its gradients are exactly zero.
    assert torch.equal(m.fc1_weight.grad[1], torch.zeros_like(m.fc1_weight.grad[1]))
    assert torch.equal(m.fc2_bias.grad[1], torch.zeros_like(m.fc2_bias.grad[1]))


def test_unary_module_shapes():
    m = moemlp.GroupedMLP(num_experts=2, hidden_size=8, ffn_hidden_size=4, activation="srelu")
    assert m.fc1_weight.shape == (2, 4, 8) and m.fc1_bias is None
    assert "srelu" in repr(m)
