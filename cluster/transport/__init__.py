"""The weight transport: how the learner's weights reach the rollout engines (``transport.py``: the interface
the driver drives; ``weights.py``: the NCCL/gloo broadcast group and its bucketed push; ``handover.py``: the
colocated hand-over on one device). The learner sends and the workers receive through it; it imports only
the wires (the bucket plan both sides compute is ``cluster/wire/buckets.py``)."""
