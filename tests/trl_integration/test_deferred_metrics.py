"""trl_integration/metrics.py and its use by the adapters: no metric is read on the host in the step.

The queue (``DeferredMetrics``) gives each function its values as Python floats, exactly and in the
order queued; the wrapped store (``ResolvingStore``) resolves it on every read, so TRL's ``log``, a
callback or a test sees the metrics an immediate read would have given (the values themselves are
held to TRL's by the trainer parity tests, 1e-4). A trainer step queues its metrics and reads the
labels' scan queued before the backbone (``scan_labels_ahead``): exact counts, CPU, tiny models.
"""

import gc
import weakref
from collections import defaultdict

import pytest
import torch

from liger_losses.chunked import tokens
from liger_losses.trl_integration import DPOTrainer, SFTTrainer
from liger_losses.trl_integration.metrics import DeferredMetrics, QueuedMetrics, ResolvingStore

from .utils import build_tiny_model, dpo_config, first_batch, preference_dataset, sft_config, sft_dataset


def test_queue_resolves_in_order_with_exact_floats():
    pending, seen = DeferredMetrics(), []
    pending.add(torch.tensor([1.5, 2.0], dtype=torch.float32), lambda v: seen.append(("a", v)))
    pending.add(None, lambda v: seen.append(("b", v)))
    pending.add([torch.tensor(3), torch.tensor(0.1, dtype=torch.float64)], lambda v: seen.append(("c", v)))
    assert seen == [] and len(pending) == 3
    pending.resolve()
    assert seen == [("a", [1.5, 2.0]), ("b", []), ("c", [3.0, 0.1])] and len(pending) == 0
    f32 = torch.tensor(0.1, dtype=torch.float32)
    pending.add(f32, lambda v: seen.append(v[0]))
    pending.resolve()
    assert seen[-1] == f32.item()  # read through float64: the float32 value exactly


def test_queue_is_bounded_and_reentrant():
    pending = DeferredMetrics(limit=3)
    store = ResolvingStore({"train": defaultdict(list)}, pending)
    for i in range(2):
        pending.add(torch.tensor(float(i)), lambda v: store["train"]["x"].append(v[0]))  # reads the store
    assert store.data["train"]["x"] == []
    pending.add(torch.tensor(2.0), lambda v: store["train"]["x"].append(v[0]))  # the limit: resolved
    assert store.data["train"]["x"] == [0.0, 1.0, 2.0] and len(pending) == 0


def test_store_reads_resolve_the_queue():
    pending = DeferredMetrics()
    store = ResolvingStore({"train": defaultdict(list), "eval": defaultdict(list)}, pending)
    pending.add(torch.tensor(4.0), lambda v: store.data["train"]["loss"].append(v[0]))
    assert dict(store["train"]) == {"loss": [4.0]}
    pending.add(torch.tensor(5.0), lambda v: store.data["eval"]["loss"].append(v[0]))
    assert list(store) == ["train", "eval"] and store.data["eval"]["loss"] == [5.0]
    pending.add(torch.tensor(6.0), lambda v: store.data["train"]["loss"].append(v[0]))
    del store["train"]  # TRL's CPO log deletes what it logged: the queued value was stored first
    assert "train" not in store.data and len(pending) == 0


def test_queued_dict_reads_and_follows():
    pending, stored = DeferredMetrics(), []
    queued = QueuedMetrics(["a", "b"], torch.tensor([1.0, 2.0]), pending)
    queued.when_resolved(stored.append)
    assert stored == [] and len(queued) == 2 and list(queued) == ["a", "b"]
    assert queued["b"] == 2.0 and stored == [{"a": 1.0, "b": 2.0}]
    queued.when_resolved(stored.append)  # already resolved: at once
    assert len(stored) == 2


def test_bad_arguments():
    with pytest.raises(ValueError, match="limit must be a positive int"):
        DeferredMetrics(limit=0)
    with pytest.raises(TypeError, match="then must be callable"):
        DeferredMetrics().add(torch.tensor(1.0), "not a function")


@pytest.fixture
def scans(monkeypatch):
    calls = []
    original = tokens.label_counts
    monkeypatch.setattr(tokens, "label_counts", lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


def _queued_step(trainer, batch, scans):
    """compute_loss on ``batch``: what it left queued, what the store held before a read, the label scans."""
    trainer._metrics["train"].clear()
    trainer.model.train()
    scans.clear()
    trainer.compute_loss(trainer.model, batch)
    return len(trainer._liger_pending), dict(trainer._metrics.data["train"]), len(scans)


def test_sft_step_queues_its_metrics_and_scans_labels_once(tok, tmp_path, scans):
    trainer = SFTTrainer(build_tiny_model(tok, seed=0), sft_config(tmp_path), train_dataset=sft_dataset(),
                         processing_class=tok, use_liger=True, liger_patch_model=False)
    queued, before, n_scans = _queued_step(trainer, first_batch(trainer), scans)
    assert queued == 1 and "entropy" not in before
    assert n_scans == 1  # the scan queued before the backbone; the loss read it
    after = trainer._metrics["train"]
    assert set(after) >= {"entropy", "mean_token_accuracy", "num_tokens"} and len(trainer._liger_pending) == 0


def test_dpo_step_queues_its_metrics_and_scans_labels_once(tok, tmp_path, scans):
    trainer = DPOTrainer(build_tiny_model(tok, seed=0), build_tiny_model(tok, seed=0), dpo_config(tmp_path),
                         train_dataset=preference_dataset(8), processing_class=tok, use_liger=True,
                         liger_patch_model=False)
    queued, before, n_scans = _queued_step(trainer, first_batch(trainer), scans)
    assert queued == 1 and "rewards/margins" not in before and n_scans == 1
    assert "rewards/margins" in trainer._metrics["train"]


def test_logged_history_is_complete(tok, tmp_path):
    """Two logged steps: every step's metrics reach TRL's log (the store is read there)."""
    trainer = SFTTrainer(build_tiny_model(tok, seed=0), sft_config(tmp_path, max_steps=2), train_dataset=sft_dataset(),
                         processing_class=tok, use_liger=True, liger_patch_model=False)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "entropy" in h]
    assert len(logs) == 2 and all(isinstance(h["entropy"], float) for h in logs)
    assert logs[1]["num_tokens"] > logs[0]["num_tokens"] > 0


@pytest.mark.parametrize("task", ["sft", "dpo"])
def test_queued_metrics_do_not_hold_the_batch(tok, tmp_path, scans, task):
    """What a step queues holds none of its batch's tensors: the queue is read at TRL's next log, so a
    batch held there stays on the device for every step until then (one batch a step)."""
    if task == "sft":
        trainer = SFTTrainer(build_tiny_model(tok, seed=0), sft_config(tmp_path), train_dataset=sft_dataset(),
                             processing_class=tok, use_liger=True, liger_patch_model=False)
    else:
        trainer = DPOTrainer(build_tiny_model(tok, seed=0), build_tiny_model(tok, seed=0), dpo_config(tmp_path),
                             train_dataset=preference_dataset(8), processing_class=tok, use_liger=True,
                             liger_patch_model=False)
    batch = first_batch(trainer)
    alive = [weakref.ref(v) for v in batch.values() if isinstance(v, torch.Tensor)]
    queued, _, _ = _queued_step(trainer, batch, scans)
    del batch
    gc.collect()
    assert queued == 1 and len(trainer._liger_pending) == 1 and alive
    assert all(ref() is None for ref in alive)
    # nor any other tensor: only the queued values vector is kept (what the functions close over,
    # through nested functions and containers; objects such as the trainer are not followed)
    [(values, then)] = trainer._liger_pending._items
    assert isinstance(values, torch.Tensor) and _closure_tensors(then) == []


def _closure_tensors(fn, seen=None):
    seen = set() if seen is None else seen
    if id(fn) in seen:
        return []
    seen.add(id(fn))
    if isinstance(fn, torch.Tensor):
        return [fn]
    if isinstance(fn, dict):
        items = list(fn.values())
    elif isinstance(fn, (list, tuple, set, frozenset)):
        items = list(fn)
    elif callable(fn) and getattr(fn, "__closure__", None):
        items = [cell.cell_contents for cell in fn.__closure__]
    else:
        return []
    return [t for item in items for t in _closure_tensors(item, seen)]
