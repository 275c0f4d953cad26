"""Run checkpoints with Orbax: every array an exact resume needs, plus a JSON record of host-side state.

A checkpoint holds two items:

* ``state``: one pytree of arrays (parameters, optimizer state, allocator / selection / controller
  states, replay buffers, the RNG key as raw ``uint32`` key data), restored with the dtypes and
  shardings of an abstract target so a resumed run continues bit for bit;
* ``meta``: a JSON object for host-side values (step, data position, counters).

Saves are asynchronous by default (the training step continues while the previous save is written);
Orbax writes into a temporary directory and renames it when the save is complete, so a run killed
mid-save resumes from the previous complete checkpoint.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

from passrate_jax.configlib import ConfigError


def abstract_like(tree: Any) -> Any:
    """The restore target for ``tree``: shapes, dtypes and shardings, no data."""
    def leaf(x):
        sharding = getattr(x, "sharding", None)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return jax.tree.map(leaf, tree)


class RunCheckpointer:
    """Keeps the last ``keep`` checkpoints of a run under ``directory/checkpoints``.

    Args:
      directory: the run directory.
      keep: how many complete checkpoints to keep.
      async_save: write in a background thread; call :meth:`wait` before reading them.
    """

    def __init__(self, directory: str | os.PathLike, keep: int = 3, async_save: bool = True):
        directory = os.fspath(directory)  # a local path or a gs:// URL (Orbax writes both)
        self.path = os.path.join(directory if "://" in directory else os.path.abspath(directory), "checkpoints")
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                               create=True)
        self._manager = ocp.CheckpointManager(
            self.path, options=options,
            item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})

    def latest_step(self) -> int | None:
        """The step of the newest complete checkpoint, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def saved_structure(self, step: int) -> Any:
        """The tree of checkpoint ``step``'s state as saved (array metadata; no array is read)."""
        return self._manager.item_metadata(step)["state"]

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Save ``state`` (a pytree of arrays) and ``meta`` (JSON-serialisable) as checkpoint ``step``."""
        self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                         meta=ocp.args.JsonSave(meta)), force=True)

    def restore(self, step: int | None, target: Any) -> tuple[Any, dict]:
        """Restore checkpoint ``step`` (default: the latest) into the structure, dtypes and shardings of
        ``target`` (concrete arrays or ``jax.ShapeDtypeStruct``s). Returns (state, meta)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint under {self.path}")
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_like(target)), meta=ocp.args.JsonRestore()))
        return restored.state, dict(restored.meta)

    def restore_saved(self, step: int | None = None) -> tuple[Any, dict]:
        """Checkpoint ``step`` (default: the latest) as saved, without a target: nested dicts of arrays
        (an nnx Variable comes back as ``{"value": array}``). For reading a run without rebuilding its
        optimizer and allocator, e.g. evaluation; the arrays land on this process's first device, whatever
        mesh saved them. Returns (state, meta)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint under {self.path}")
        # Onto this process's first device, whatever topology saved it (a pod run read on a laptop).
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
                              self._manager.item_metadata(step)["state"])
        restored = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                                       meta=ocp.args.JsonRestore()))
        return restored.state, dict(restored.meta)

    def wait(self) -> None:
        """Block until every pending asynchronous save is complete."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def check_run_dir(run_dir: str | os.PathLike, state: Any = None) -> None:
    """Fail before training when the run directory cannot hold a checkpoint: not writable, or (with
    ``state``, the pytree a checkpoint saves) less free space than one checkpoint of it needs.
    Remote (``gs://``) directories are left to Orbax. Raises :class:`ConfigError` naming the directory."""
    run_dir = os.fspath(run_dir)
    if "://" in run_dir:
        return
    probe = os.path.join(run_dir, f".write-test-{os.getpid()}")
    try:
        os.makedirs(run_dir, exist_ok=True)
        with open(probe, "w") as f:
            f.write("x")
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"run directory {run_dir!r} is not writable: {e}") from None
    if state is not None:
        need = sum(x.nbytes for x in jax.tree.leaves(state) if hasattr(x, "nbytes"))
        free = shutil.disk_usage(run_dir).free
        if free < need:
            raise ConfigError(f"run directory {run_dir!r} has {free / 2**20:.1f} MiB free; one checkpoint of this run "
                              f"needs {need / 2**20:.1f} MiB")


def load_params(run_dir: str | os.PathLike, params: Any, step: int | None = None) -> int:
    """Overwrite ``params`` (an ``nnx.State`` of the run's model) in place with the parameters of checkpoint
    ``step`` (default: the latest) of ``run_dir``, read without rebuilding the optimizer or allocator.
    Returns the step. A step that was not saved (or a run with no checkpoint) is a ConfigError listing
    the steps there are."""
    ckpt = RunCheckpointer(run_dir)
    try:
        saved = sorted(ckpt.all_steps())
        if not saved or (step is not None and step not in saved):
            raise ConfigError(f"--step {step}: {os.fspath(run_dir)!r} has checkpoints at steps {saved}"
                              if saved else f"--run-dir {os.fspath(run_dir)!r}: no complete checkpoint yet")
        state, meta = ckpt.restore_saved(step)
    finally:
        ckpt.close()

    def unwrap(tree):
        # Orbax stores each nnx Variable as {"value": array}; nnx's pure dicts hold the arrays.
        if isinstance(tree, dict):
            return unwrap(tree["value"]) if set(tree) == {"value"} else {k: unwrap(v) for k, v in tree.items()}
        return tree

    nnx.replace_by_pure_dict(params, unwrap(state["params"]))
    return int(meta["step"])
