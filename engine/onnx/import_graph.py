"""Import of a graph that joins: chains of supported nodes whose values meet in a residual
``Add`` of two computed values (``x + block(x)``), read into an ``nn.Model``.

Each maximal chain (a value with one user, not the output) is read by the chain importer's
machinery (``engine.onnx.import_``'s ``IMPORTERS``) into an ``nn.Sequential``; a step list
says which value each chain reads and each Add joins. What is not a chain or such an Add (a
node combining other computed values, several inputs or outputs) stays a ValueError naming
the node."""
import numpy as np

from engine import nn
from engine.interop import sequential


class GraphModel(nn.Model):
    """The model ``engine.onnx.load`` reads from a graph with residual joins: ``chains`` (an
    ``nn.LayerList`` of Sequentials) and ``steps``, each ``("chain", index or None, source,
    result)`` (None: a chain of identities) or ``("add", a, b, result)``, run in order from
    the value ``source`` (the graph's input) to the value ``result``."""

    def __init__(self, chains, steps, source, result, **kwargs):
        super().__init__(**kwargs)
        self.chains = nn.LayerList(chains)
        self.steps, self.source, self.result = [tuple(step) for step in steps], source, result

    def forward(self, x):
        values = {self.source: x}
        for kind, first, second, result in self.steps:
            if kind == "add":
                values[result] = values[first] + values[second]
            else:
                values[result] = values[second] if first is None else \
                    self.chains[first](values[second])
        return values[self.result]


def joins(reader, nodes, input_name):
    """Whether the graph's ``nodes`` (GELU compositions folded) add two computed values."""
    computed = {input_name}
    for node in nodes:
        data = [name for name in node.input if name in computed]
        if not data or node.op_type == "Shape":
            continue
        if len(data) > 1:
            return True
        computed.update(name for name in node.output if name)
    return False


def read_graph(reader, nodes, graph_input, output, dtype, import_chain):
    """The ``GraphModel`` of ``nodes`` from ``graph_input`` (its feature shape read) to the
    value ``output``; ``import_chain(nodes, shape, dtype)`` -> (layer descriptions, shape)."""
    computed, users, steps, tails = {graph_input.name}, {}, [], {}
    order = []
    for node in nodes:
        data = [name for name in node.input if name in computed]
        if not data or node.op_type == "Shape":
            continue
        if len(data) > 1 and not (node.op_type == "Add" and len(data) == 2
                                  and len(node.input) == 2):
            raise reader.fail(node, f"combines {len(data)} computed values {data}: the "
                                    "importer joins two values only by a residual Add")
        order.append((node, data))
        for name in data:
            users[name] = users.get(name, 0) + 1
        computed.update(name for name in node.output if name)
    if output not in computed:
        raise reader.fail(None, f"the output {output!r} is not computed from the input "
                                f"{graph_input.name!r}")
    chains = []   # [source value, [nodes]]
    for node, data in order:
        if len(data) == 2:
            steps.append(("add", data[0], data[1], node.output[0]))
            continue
        source = data[0]
        chain = tails.pop(source, None)
        if chain is None or users[source] != 1 or source == output:
            chain = [source, []]
            chains.append(chain)
            steps.append(("chain", len(chains) - 1, source, None))
        chain[1].append(node)
        tails[node.output[0]] = chain
    shapes, final, model_chains = {graph_input.name: reader.shapes[graph_input.name]}, [], []
    for kind, first, second, result in steps:   # in the graph's order: sources come first
        if kind == "add":
            if shapes[first] != shapes[second]:
                raise reader.fail(None, f"a residual Add of shapes {shapes[first]} and "
                                        f"{shapes[second]}: the importer adds equal shapes")
            shapes[result] = shapes[first]
            final.append((kind, first, second, result))
            continue
        source, chain_nodes = chains[first]
        layers, shape = import_chain(chain_nodes, shapes[source], dtype)
        result = chain_nodes[-1].output[0]
        shapes[result] = shape
        if layers:
            model_chains.append(sequential.build(
                sequential.fuse_activations(layers), shapes[source], dtype,
                f"chain_{len(model_chains)}", f"engine.onnx.load: {reader.path!r}"))
        final.append(("chain", len(model_chains) - 1 if layers else None, source, result))
    return GraphModel(model_chains, final, graph_input.name, output,
                     name=reader.graph.name or "onnx_graph")
