"""Loss options that follow the trainer's attributes, as TRL's own loss does.

TRL's preference trainers copy their loss options from the config into attributes at construction
(``self.beta``, DPO's ``self.loss_types``, KTO's ``self.desirable_weight``...) and read those attributes at every
step, so a callback that sets ``trainer.beta`` (a beta schedule) changes TRL's objective from the next step on.
Our adapters build their loss module (``trainer.liger_loss``) from the config once; :class:`LiveLoss` rebuilds it
at the start of a step whose option values differ from the ones it was built with, so the same callback changes
ours alike. Unchanged values cost one tuple comparison per step.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

from torch import nn


class ConfigView:
    """The trainer's config ``args`` with the fields of ``overrides`` read from there instead (a read-only view:
    the loss builders only read attributes)."""

    def __init__(self, args: Any, overrides: Mapping[str, Any]):
        self._args, self._overrides = args, dict(overrides)

    def __getattr__(self, name: str) -> Any:
        overrides = self.__dict__.get("_overrides", {})
        if name in overrides:
            return overrides[name]
        return getattr(self.__dict__["_args"], name)


def _frozen(value: Any) -> Any:
    """``value`` comparable and hashable: lists and tuples as tuples, recursively."""
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


class LiveLoss:
    """Keeps ``trainer.liger_loss`` built from the option values TRL's loss reads now.

    ``fields`` maps each config field the loss takes to the trainer attribute TRL reads it from (None: TRL reads
    the config itself, ``trainer.args``); ``build(config) -> nn.Module`` builds the loss from a config-like object
    (the adapter's builder with its chunk size and the head's logit transform). Made after the loss is built from
    the trainer's config, it records those values."""

    def __init__(self, trainer: Any, fields: Mapping[str, Optional[str]], build: Callable[[Any], nn.Module]):
        self.fields, self.build = dict(fields), build
        self.values = self._values(trainer)

    def _values(self, trainer: Any) -> dict:
        out = {}
        for field, attr in self.fields.items():
            source = trainer if attr is not None and hasattr(trainer, attr) else trainer.args
            out[field] = getattr(source, attr if source is trainer else field)
        return out

    def refresh(self, trainer: Any) -> None:
        """Rebuild ``trainer.liger_loss`` if an option value changed since it was built (a ``ValueError`` of the
        builder names a value it cannot serve, as at construction)."""
        values = self._values(trainer)
        if {k: _frozen(v) for k, v in values.items()} == {k: _frozen(v) for k, v in self.values.items()}:
            return
        trainer.liger_loss = self.build(ConfigView(trainer.args, values))
        self.values = values
