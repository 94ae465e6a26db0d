"""How much memory a task's inputs take at least, read from its source without running it: the tensors its
`get_inputs()` creates with torch's factories (`torch.rand(batch_size, dim)`), their sizes evaluated from the
module's constants. A lower bound (what it cannot read counts nothing), so a task it says cannot fit never could;
the parent reports it before a worker runs out of memory on it (references.py)."""

from __future__ import annotations

import ast
import operator

_FACTORIES = {"rand", "randn", "zeros", "ones", "empty", "full", "randint"}
_BYTES = {"float16": 2, "half": 2, "bfloat16": 2, "float32": 4, "float": 4, "float64": 8, "double": 8,
          "int64": 8, "long": 8, "int32": 4, "int": 4, "int16": 2, "short": 2, "int8": 1, "uint8": 1, "bool": 1,
          "complex64": 8, "complex128": 16}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Pow: operator.pow}


def min_input_bytes(code: str) -> int:
    """Bytes of the tensors `get_inputs()` creates with torch factories whose sizes are constants (0 when none)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return 0
    names: dict[str, object] = {}
    get_inputs = None
    for node in tree.body:
        if isinstance(node, ast.Assign):  # batch_size = 16; height = width = 128
            value = _value(node.value, names)
            for target in node.targets:
                if value is not None and isinstance(target, ast.Name):
                    names[target.id] = value
        elif isinstance(node, ast.FunctionDef) and node.name == "get_inputs":
            get_inputs = node
    if get_inputs is None:
        return 0
    total = 0
    for node in ast.walk(get_inputs):
        if isinstance(node, ast.Call) and _is_factory(node.func):
            total += _call_bytes(node, names)
    return total


def _is_factory(func: ast.expr) -> bool:
    return (isinstance(func, ast.Attribute) and func.attr in _FACTORIES and isinstance(func.value, ast.Name)
            and func.value.id == "torch")


def _call_bytes(call: ast.Call, names: dict) -> int:
    kwargs = {k.arg: k.value for k in call.keywords if k.arg}
    name = call.func.attr
    if name == "randint":  # randint(high, size) or randint(low, high, size)
        size = kwargs.get("size") or (call.args[-1] if len(call.args) >= 2 else None)
        dims = _value(size, names)
    else:  # rand(2, 3), rand((2, 3)), rand(size=(2, 3)), full((2, 3), value)
        sizes = [kwargs["size"]] if "size" in kwargs else call.args[:1] if name == "full" else call.args
        dims = _value(ast.Tuple(elts=list(sizes)), names)  # (batch_size, *input_shape)
    numel = _numel(dims)
    if numel is None:
        return 0
    dtype = kwargs.get("dtype")
    default = 8 if name == "randint" else 4  # int64, float32
    width = _BYTES.get(dtype.attr, default) if isinstance(dtype, ast.Attribute) else default
    return numel * width


def _numel(dims) -> int | None:
    """Elements of a size given as ints and tuples of ints (torch.rand(2, 3), torch.rand((2, 3)))."""
    if isinstance(dims, int):
        return dims if dims >= 0 else None
    if isinstance(dims, (list, tuple)):
        n = 1
        for d in dims:
            sub = _numel(d)
            if sub is None:
                return None
            n *= sub
        return n
    return None


def _value(node: ast.expr | None, names: dict):
    """An int, float or tuple the expression evaluates to from literals and known names; None otherwise."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.Name):
        return names.get(node.id)
    if isinstance(node, (ast.Tuple, ast.List)):
        items = []
        for elt in node.elts:
            if isinstance(elt, ast.Starred):
                inner = _value(elt.value, names)
                if not isinstance(inner, tuple):
                    return None
                items.extend(inner)
            else:
                items.append(_value(elt, names))
        return None if any(i is None for i in items) else tuple(items)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left, names), _value(node.right, names)
        if isinstance(left, (int, float)) and isinstance(right, (int, float)):
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                return None
            try:
                return _OPS[type(node.op)](left, right)
            except (ZeroDivisionError, OverflowError):
                return None
    return None
