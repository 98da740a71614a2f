"""``save(metadata=...)`` refusing a value names where it is (the standards: bad input gets
an error naming the key or value). Found by adv2: the message was the same generic sentence
for every refused metadata, e.g. a numpy float three levels down."""

import numpy as np
import pytest
import torch

import zerostall
from zerostall.errors import UnsupportedStateError


@pytest.mark.parametrize("metadata, where", [
    ({"optim": {"lr": np.float64(1e-3)}}, "optim.lr"),
    ({"hist": [1, 2, float("nan")]}, "hist.2"),
    ({"run": {7: "x"}}, "run"),
])
def test_refused_metadata_names_the_key(ckdir, metadata, where):
    with zerostall.Checkpointer(ckdir) as ck:
        with pytest.raises(UnsupportedStateError, match=f"'{where}'"):
            ck.save(1, {"w": torch.ones(2)}, metadata=metadata)
        assert ck.steps() == []


def test_metadata_that_is_not_a_dict_is_refused(ckdir):
    with zerostall.Checkpointer(ckdir) as ck:
        with pytest.raises(UnsupportedStateError, match="metadata= must be a dict"):
            ck.save(1, {"w": torch.ones(2)}, metadata=[1])
