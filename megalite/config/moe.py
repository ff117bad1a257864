"""--moe-layer-freq: which transformer layers have a Mixture-of-Experts MLP.

Megatron-LM accepts an int k (layer i is MoE when i % k == 0) or a Python list expression of
0/1 per layer ("([0]+[1]*3)*2"), which it evaluates. Here the expression is parsed, not
evaluated: only list displays of 0/1, `+` and `*` by an int are accepted."""
from __future__ import annotations

import ast


def _evaluate(node):
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.List):
        return [_evaluate(e) for e in node.elts]
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        a, b = _evaluate(node.left), _evaluate(node.right)
        return a + b if isinstance(node.op, ast.Add) else a * b
    raise ValueError("not a list of 0/1 built with [...], + and *")


def every_nth_pattern(freq, num_layers: int) -> list[bool]:
    """Per layer, True except for every N-th layer counted from 1 (an int N); a Python list of 0/1
    per layer (moe_layer_pattern's syntax) gives each layer. Raises ValueError (with why)."""
    text = str(freq).strip().strip("'\"")
    if text.lstrip("-").isdigit():
        n = int(text)
        if n < 1:
            raise ValueError(f"an integer >= 1 or a list, got {n}")
        return [(i + 1) % n != 0 for i in range(num_layers)]
    return moe_layer_pattern(text, num_layers)


def moe_layer_pattern(freq, num_layers: int) -> list[bool]:
    """Per layer, whether it is an MoE layer. Raises ValueError (with why) for a bad value."""
    text = str(freq).strip().strip("'\"")
    if text.lstrip("-").isdigit():
        k = int(text)
        if k < 1:
            raise ValueError(f"an integer >= 1 or a list, got {k}")
        return [i % k == 0 for i in range(num_layers)]
    try:
        pattern = _evaluate(ast.parse(text, mode="eval"))
    except (SyntaxError, ValueError, TypeError) as e:
        raise ValueError(f"an integer or a Python list of 0/1 per layer, got {text!r} ({e})") from None
    if not isinstance(pattern, list) or any(v not in (0, 1) for v in pattern):
        raise ValueError(f"a list of 0/1 per layer, got {text!r}")
    if len(pattern) != num_layers:
        raise ValueError(f"{len(pattern)} entries for {num_layers} layers (--num-layers)")
    return [bool(v) for v in pattern]
