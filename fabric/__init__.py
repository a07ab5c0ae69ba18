"""The library users import, as `weightfabric` (``import weightfabric as wf``).

Workers (`worker`), model stores (`store`), the fetch engine (`fetch`), arenas,
transports, GPU regions (`gpu`), receive-path relayout (`relayout`) and the hub,
the control plane (`hub`: only the hub process imports it).
"""
