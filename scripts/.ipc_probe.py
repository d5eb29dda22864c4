"""Probe: does the judge's process keep one output's memory per trial when lending slots to a sandbox?"""
import os, subprocess, sys, tempfile, time
from pathlib import Path
import torch
from kernelpilot.harness.sandbox_client import SandboxPool
from kernelpilot.harness.shared import SharedArena, share_tree

variant = sys.argv[1]
if variant in ("nolandlock", "devshm"):
    import kernelpilot.harness.process as process
    original = process.sandbox_environment
    def patched(env, private_dir):
        out = original(env, private_dir)
        if variant == "nolandlock":
            out.pop("KERNELPILOT_SANDBOX_WRITABLE", None)
        else:
            out["KERNELPILOT_SANDBOX_WRITABLE"] += os.pathsep + "/dev/shm"
        return out
    process.sandbox_environment = patched
tmp = Path(tempfile.mkdtemp())
problem = tmp / "model.py"
problem.write_text("""
import torch
from torch import nn
class Model(nn.Module):
    def forward(self, x):
        return x.repeat(1, 8, 1, 1)
def get_inputs():
    return [torch.randn(4, 16, 1024, 1024)]
def get_init_inputs():
    return []
""")
os.environ["KERNELPILOT_SHARED_DIR"] = str(tmp)
pool = SandboxPool("cuda", tmp)
sb = pool.take()
print("load", sb.load("eager", problem, seed=0, timeout=120).get("ok"), flush=True)

def used(pid):
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
    return {int(l.split(",")[0]): int(l.split(",")[1]) for l in out.splitlines() if l.strip()}.get(pid)

from kernelpilot.problem import load_problem
prob = load_problem(problem)
persistent = SharedArena("cuda") if variant == "persistent" else None
for trial in range(4):
    arena = persistent or SharedArena("cuda")
    inputs = prob.make_inputs(torch.device("cuda"), trial)
    out = prob.make_model("cpu").cuda()(*inputs)
    shared_inputs, desc = share_tree(arena, inputs)
    slot, ref = arena.like(out)
    reply = sb.request("call", {"inputs": desc, "slots": [ref], "seed": trial, "reference_aliases_inputs": False}, timeout=120)
    ok = torch.equal(slot, out)
    del shared_inputs, slot, out, inputs
    if variant == "collect-first":
        torch.cuda.ipc_collect()
    if persistent is None:
        arena.close()
    else:
        torch.cuda.ipc_collect(); torch.cuda.empty_cache()
    if variant == "sleep":
        time.sleep(1.0); torch.cuda.ipc_collect(); torch.cuda.empty_cache()
    print(f"{variant} trial {trial}: ok={ok} reply_ok={reply.get('ok')} judge nvidia-smi MiB={used(os.getpid())} reserved={torch.cuda.memory_reserved() >> 20} sandbox MiB={used(sb.pid)}", flush=True)
sb.close(); pool.close()
