"""A reused Checkpointer picks up every change of a many-tensor state between saves (the plan
cache of staging/plan.py takes containers of tensors in bulk): each step loads back exactly."""

import torch

import zerostall


def _state(n=300):
    g = torch.Generator().manual_seed(1)
    return {"optim": {f"state.{i}.exp_avg": torch.randn(3 + i % 5, generator=g) for i in range(n)},
            "keys": {1: torch.ones(2)},
            "lr": 0.1, "step": 4}


def _same(a, b):
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b) and [type(k) for k in a] == [type(k) for k in b]
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b or (a != a and b != b), (a, b)


def _edits():
    """Each edit changes the state in a way the next save must pick up."""
    def replace_tensor(s):
        s["optim"]["state.7.exp_avg"] = torch.full((4,), 2.5)

    def add_key(s):
        s["optim"]["state.new"] = torch.arange(6, dtype=torch.int64)

    def remove_key(s):
        del s["optim"]["state.3.exp_avg"]

    def resize_in_place(s):
        s["optim"]["state.5.exp_avg"].resize_(11).fill_(7.0)

    def shrink_in_place(s):  # same storage and address, new shape
        s["optim"]["state.6.exp_avg"].resize_(2)

    def same_storage_other_view(s):  # same address, new shape and strides
        t = s["optim"]["state.13.exp_avg"]
        s["optim"]["state.13.exp_avg"] = t[: t.numel() // 2 * 2].view(2, -1).t()

    def dtype_changed(s):
        t = s["optim"]["state.9.exp_avg"]
        t.data = t.data.to(torch.float64) * 3

    def plain_value(s):
        s["lr"] = 0.05

    def int_key_to_bool_key(s):
        s["keys"] = {True: s["keys"].pop(1)}

    def tied(s):
        s["optim"]["state.11.exp_avg"] = s["optim"]["state.10.exp_avg"]

    def reorder(s):
        s["optim"] = dict(reversed(list(s["optim"].items())))

    def nested(s):
        s["optim"]["state.12.exp_avg"] = {"a": torch.ones(2), "b": [torch.zeros(3), 1.5]}

    def in_place_values(s):
        for t in list(s["optim"].values())[:50]:
            if isinstance(t, torch.Tensor):
                t.add_(1)

    return [replace_tensor, add_key, remove_key, resize_in_place, shrink_in_place, same_storage_other_view, dtype_changed, plain_value,
            int_key_to_bool_key, tied, reorder, nested, in_place_values]


def test_reused_checkpointer_picks_up_every_change(tmp_path):
    state = _state()
    with zerostall.Checkpointer(tmp_path / "ck") as ck:
        ck.save(0, state).result()
        ck.save(1, state).result()  # the cached plan
        _same(state, zerostall.load(tmp_path / "ck", step=1))
        for i, edit in enumerate(_edits(), start=1):
            edit(state)
            for step in (2 * i, 2 * i + 1):  # the new plan, then the plan cached for the changed state
                ck.save(step, state).result()
                _same(state, zerostall.load(tmp_path / "ck", step=step))


def test_step_counter_and_growing_log_load_back_at_every_step(tmp_path):
    """Plain values that change every save (a trainer's step, its log history) reuse the
    tensor layout (staging/plan_cache.py): each step still loads back exactly as saved."""
    state = _state(200)
    state["trainer"] = {"global_step": 0, "log_history": []}
    with zerostall.Checkpointer(tmp_path / "ck") as ck:
        for step in range(6):
            state["trainer"]["global_step"] = step
            state["trainer"]["log_history"].append({"step": step, "loss": 1.0 / (step + 1)})
            for t in list(state["optim"].values())[:10]:
                t.add_(1)
            ck.save(step, state).result()
            _same(state, zerostall.load(tmp_path / "ck", step=step))
        assert zerostall.load(tmp_path / "ck", step=2)["trainer"]["log_history"][-1]["step"] == 2
