"""Generated protobuf code for Sparkplug B: do not edit; regenerate as below.

``sparkplug_b.proto`` is the official schema (Eclipse Tahu, ``sparkplug_b/sparkplug_b.proto``,
EPL-2.0). ``sparkplug_b_pb2.py`` and ``.pyi`` were generated from it with grpcio-tools
1.85.1 (protoc for protobuf 7.35.1, hence ``protobuf>=7.35.1`` in pyproject.toml)::

    pip install grpcio-tools
    cd src/shoal/adapters/_proto
    python -m grpc_tools.protoc --proto_path=. --python_out=. --pyi_out=. sparkplug_b.proto
"""
