"""`dsv41 compile --format onnx`: the captured phase graphs as ONNX files, for inspection.

Each FX node of the torch.export program becomes one ONNX node: our custom ops in the `dsv41`
domain (op_type = the op's name), aten ops in the `org.pytorch.aten` domain (op_type = the aten
overload, e.g. `linear.default`), Python scalar arithmetic on symbolic sizes in
`org.pytorch.sym`. Non-tensor arguments (ints, floats, lists, dtypes) are kept as node attributes
so the graph reads like the program. Weights are graph inputs with their shapes and dtypes, not
initializers (the files stay small and hold no weights); symbolic dims are `dim_param`s. The
files are meant for ONNX viewers and tools, not for an ONNX runtime (the aten domain has no
kernels there); the compiled TVM artifact is the executable form.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dsv41.compiler.capture import capture
from dsv41.graph.entries import ENTRIES
from dsv41.graph.model import Model

ONNX_DTYPES = {
    torch.float32: 1, torch.uint8: 2, torch.int8: 3, torch.int32: 6, torch.int64: 7,
    torch.bool: 9, torch.float64: 11, torch.bfloat16: 16,
}


def _value_info(name: str, val):
    import onnx  # heavy: onnx (~1 s): build imports this module; only --format onnx needs it
    from onnx import helper  # heavy: onnx, as above

    if not isinstance(val, torch.Tensor):
        return helper.make_empty_tensor_value_info(name)
    dims = [int(d) if not isinstance(d, torch.SymInt) else str(d) for d in val.shape]
    dtype = ONNX_DTYPES.get(val.dtype, onnx.TensorProto.UNDEFINED)
    return helper.make_tensor_value_info(name, dtype, dims)


def _attr_value(v):
    """A node argument that is not a graph value, as an ONNX attribute value (or None)."""
    if isinstance(v, bool | int | float | str):
        return v
    if isinstance(v, torch.dtype):
        return str(v).replace("torch.", "")
    if isinstance(v, list | tuple) and all(isinstance(x, int | float) for x in v):
        return list(v) if v else None
    if v is None:
        return "None"
    return str(v)


def graph_to_onnx(ep, name: str):
    """An ExportedProgram -> onnx.ModelProto (structure, shapes and dtypes only)."""
    import onnx  # heavy: onnx (~1 s): build imports this module; only --format onnx needs it
    from onnx import helper  # heavy: onnx, as above

    nodes, inputs, outputs = [], [], []
    for n in ep.graph.nodes:
        val = n.meta.get("val")
        if n.op == "placeholder":
            if isinstance(val, torch.Tensor):
                inputs.append(_value_info(n.name, val))
            continue
        if n.op == "output":
            for a in n.args[0]:
                if isinstance(a, torch.fx.Node):
                    outputs.append(_value_info(a.name, a.meta.get("val")))
            continue
        target = n.target
        if isinstance(target, torch._ops.OpOverload):
            ns = target.namespace
            domain = "dsv41" if ns == "dsv41" else f"org.pytorch.{ns}"
            op_type = (target._schema.name.split("::")[-1] + "." + target._overloadname
                       if ns != "dsv41" else target._schema.name.split("::")[-1])
        else:
            domain, op_type = "org.pytorch.sym", getattr(target, "__name__", str(target))
        ins, attrs = [], {}
        for i, a in enumerate(n.args):
            if isinstance(a, torch.fx.Node):
                ins.append(a.name)
            elif isinstance(a, list | tuple) and any(isinstance(x, torch.fx.Node) for x in a):
                ins.extend(x.name for x in a if isinstance(x, torch.fx.Node))
            else:
                v = _attr_value(a)
                if v is not None:
                    attrs[f"arg{i}"] = v
        for k, a in n.kwargs.items():
            v = _attr_value(a) if not isinstance(a, torch.fx.Node) else None
            if isinstance(a, torch.fx.Node):
                ins.append(a.name)
            elif v is not None:
                attrs[k] = v
        if isinstance(val, tuple | list):
            outs = [f"{n.name}.{i}" for i in range(len(val))]
        else:
            outs = [n.name]
        nodes.append(helper.make_node(op_type, ins, outs, name=n.name, domain=domain, **attrs))
        # getitem on a multi-output node reads one of its outputs
        if op_type == "getitem" and n.args and isinstance(n.args[0], torch.fx.Node):
            nodes[-1] = helper.make_node("Identity", [f"{n.args[0].name}.{n.args[1]}"], outs,
                                         name=n.name)
    graph = helper.make_graph(nodes, name, inputs, outputs)
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("dsv41", 1),
              helper.make_opsetid("org.pytorch.aten", 1), helper.make_opsetid("org.pytorch.sym", 1)]
    model = helper.make_model(graph, opset_imports=opsets, producer_name="dsv41")
    model.ir_version = onnx.IR_VERSION
    return model


def export_onnx(opts) -> list[Path]:
    """One .onnx per entry into the artifact directory."""
    import onnx  # heavy: onnx (~1 s): build imports this module; only --format onnx needs it

    model = Model.placeholder(opts.args)
    out = []
    for entry in opts.entries:
        if entry not in ENTRIES:
            raise ValueError(f"Unknown entry {entry!r}.")
        ep, _ = capture(model, entry)
        proto = graph_to_onnx(ep, f"{opts.model_name}.{entry}")
        path = opts.artifact_dir / f"{entry}.onnx"
        onnx.save(proto, str(path))
        out.append(path)
    return out
