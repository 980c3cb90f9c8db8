"""One process of the two-process training run of ``test_distributed.py``.

Usage: ``python distributed_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR CONFIG``.

Joins ``jax.distributed`` on CPU (gloo collectives, coordinator on 127.0.0.1:PORT), trains the
model of ``test_distributed.py`` data parallel over one device per process (each process feeds
its part of every global batch, ``ProcessPart``) for 2 steps with a checkpoint, then resumes
from that checkpoint in a second ``fit`` (a multi-process restore) up to 4 steps, and writes
its copy of the final parameters to ``OUT_DIR/final_<process>.npz``. Process 0 writes the log.
Then both run ``lowrank-jax train CONFIG --out OUT_DIR/run --distributed`` (``run_train`` in the
same distributed runtime).
"""

import os
import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")

pid, n, port, out, config = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4],
                             sys.argv[5])
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=n,
                           process_id=pid)

import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_distributed import model, optimizer, sampler  # noqa: E402

from lowrank_jax.leaves import path_str  # noqa: E402
from lowrank_jax.recipes.train import run_train  # noqa: E402
from lowrank_jax.train import Checkpointer, ProcessPart, fit, full_params  # noqa: E402

assert jax.process_count() == n and len(jax.local_devices()) == 1
mesh = Mesh(np.array(jax.devices()), ("data",))
params, loss_fn = model()
common = dict(key=jax.random.key(7), optimizer=optimizer(), mesh=mesh, progress=False,
              checkpoint_every=2, log_path=os.path.join(out, "metrics.jsonl"))
fit(loss_fn, params, ProcessPart(sampler()), steps=2,
    checkpointer=Checkpointer(os.path.join(out, "checkpoints")), **common)
state, history = fit(loss_fn, params, ProcessPart(sampler()), steps=4,
                     checkpointer=Checkpointer(os.path.join(out, "checkpoints")), **common)
assert [h["step"] for h in history] == [3, 4], history
assert not state.params["enc"].u.is_fully_addressable  # a global array over both processes
final = multihost_utils.process_allgather(full_params(state), tiled=True)
np.savez(os.path.join(out, f"final_{pid}.npz"),
         **{path_str(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(final)})
multihost_utils.sync_global_devices("fit done")
summary = run_train(config, os.path.join(out, "run"), progress=False)
assert (summary["steps"] == 2) if pid == 0 else summary == {}
multihost_utils.sync_global_devices("done")
print(f"process {pid}: done", flush=True)
