"""``trainlint server``: a Language Server over stdio (needs the ``lsp`` extra: pygls, lsprotocol).

``link`` is the only module that touches the engine, the configuration and ``--verify``; ``convert``
turns findings into LSP objects (positions in the client's units); ``handlers`` wires both to pygls;
``server`` is the command (``trainlint server``).
"""
