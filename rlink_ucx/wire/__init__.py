"""The bottom layer: what goes on the wire, and nothing that moves it.

- ``codec``: field specs and schemas, numpy/torch/cupy arrays <-> raw bytes, the dtype allowlist;
- ``messages``: the typed control messages (msgspec, length-prefixed; never pickle);
- ``frame``: the fixed binary header in front of every data frame;
- ``manifest``: where each tensor of a model version lies in its flat buffer;
- ``auth``: the HMAC proofs of the handshake, the data-plane attach and the opening of a weights stream.
"""
