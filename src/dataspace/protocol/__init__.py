"""Sans-IO protocol machines: bytes in, events and effects out (no sockets, no clocks).

See the modules of this package: :mod:`dataspace.protocol.sturdy` (capabilities and their
attenuation caveats), and the relay, gatekeeper and upstream machines.
"""
