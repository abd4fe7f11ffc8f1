"""``wire_layout``: a receiver takes the learner's dtypes (a bf16 learner, float32 engines), never its
names or shapes -- those must be the receiver's own, or the push would load the wrong tensors."""
import pytest
import torch

from sonar.cluster.transport.weights import TensorSpec, layout_digest, plan_buckets, wire_layout

OWN = [TensorSpec("embed", (10, 4), torch.float32), TensorSpec("norm", (4,), torch.float32)]


def test_the_senders_dtypes_set_the_buckets():
    sender = [TensorSpec("embed", (10, 4), torch.bfloat16), TensorSpec("norm", (4,), torch.bfloat16)]
    wire = wire_layout(OWN, sender)
    assert wire == sender and layout_digest(wire) == layout_digest(sender) != layout_digest(OWN)
    assert [b.dtype for b in plan_buckets(wire)] == [torch.bfloat16]
    assert wire_layout(OWN, OWN) == OWN


@pytest.mark.parametrize("sender, match", [
    ([TensorSpec("embed", (10, 4), torch.float32)], r"sends 1 tensors, this engine has 2"),
    ([TensorSpec("embed", (10, 4), torch.float32), TensorSpec("norm2", (4,), torch.float32)], r"tensor 1 is norm2"),
    ([TensorSpec("embed", (12, 4), torch.float32), TensorSpec("norm", (4,), torch.float32)], r"embed \(12, 4\).*\(10, 4\)"),
])
def test_a_different_model_is_refused_naming_the_tensor(sender, match):
    with pytest.raises(ValueError, match=match):
        wire_layout(OWN, sender)
