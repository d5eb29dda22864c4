"""`kernelpilot.load` and `kernelpilot.swap`: only an accepted, unchanged candidate loads; a swapped-in ModelNew
holds the submodule's own tensors in its mode; an accepted workspace built with the CPU stand-in kernel loads and
swaps in a fresh process started in another folder; on a GPU, the built-in policy's kernels swapped into a model
give the model's output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import kernelpilot
from kernelpilot.deploy import DeployError, swap_module
from kernelpilot.lockfile import LOCK_NAME, lock_from_eval, read_lock, write_lock
from kernelpilot.workspace import EXAMPLE_KERNELS, init_workspace

from capture_testing import SCALE_MUL_MODEL_NEW, model_new_class
from kp_testing import EXAMPLES, REPO_ROOT, run_cache_dir, scale_mul_binding
from vcs_testing import verified_result


def captured_mlp(user_package, folder: Path):
    """The user's Net and its MLP's problem file, captured on the CPU."""
    torch.manual_seed(0)
    net = user_package.Net()
    with kernelpilot.capture(net.mlp, folder / "mlp.py"):
        net(torch.randn(4, 16), torch.rand(4, 16))
    return net, folder / "mlp.py"


def mlp_workspace(user_package, tmp_path):
    _, problem = captured_mlp(user_package, tmp_path / "problems")
    ws, _ = init_workspace(problem, tmp_path / "kp-mlp", device="cpu")
    return ws


# ------------------------------------------------------------------------------------------ load refuses


def test_load_refuses_a_workspace_nothing_was_accepted_in(tmp_path, user_package):
    ws = mlp_workspace(user_package, tmp_path)
    with pytest.raises(DeployError, match=f"has no accepted candidate: there is no {LOCK_NAME} in it") as refused:
        kernelpilot.load(ws.root)
    assert "kernelpilot accept" in refused.value.hint
    assert not ws.build_dir.exists(), "nothing was built"


def test_load_refuses_a_candidate_changed_since_it_was_accepted(tmp_path, user_package):
    ws = mlp_workspace(user_package, tmp_path)
    write_lock(ws, lock_from_eval(ws, verified_result(ws)))
    (ws.kernels_dir / "example_scale_shift.cu").write_text("// edited after accept\n")
    ws.model_new_path.write_text(ws.model_new_path.read_text() + "\n# edited\n")

    with pytest.raises(DeployError) as refused:
        kernelpilot.load(ws.root)
    assert refused.value.message == (
        f"The candidate in {ws.root} changed since it was accepted (kernels/example_scale_shift.cu, model_new.py), "
        "so a build of it is not what was verified."
    )
    assert "git checkout" in refused.value.hint
    assert not ws.build_dir.exists()


def test_load_refuses_a_lock_file_of_another_problem(tmp_path, user_package):
    ws = mlp_workspace(user_package, tmp_path)
    lock = lock_from_eval(ws, verified_result(ws))
    lock.problem_id = "0123456789abcdef"
    write_lock(ws, lock)
    with pytest.raises(DeployError, match="was written for another problem"):
        kernelpilot.load(ws.root)


# -------------------------------------------------------------------------------------------- swapping


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_a_swapped_in_model_new_holds_the_submodules_own_tensors_in_its_mode(tmp_path, user_package, training):
    net, problem = captured_mlp(user_package, tmp_path)
    x, mask = torch.randn(4, 16), torch.rand(4, 16)
    expected = net(x, mask)
    original = net.mlp
    original.train(training)
    original_tensors = {**dict(original.named_parameters()), **dict(original.named_buffers())}

    replacement = swap_module(net, "mlp", model_new_class(problem))

    assert net.mlp is replacement and type(replacement).__name__ == "ModelNew"
    assert all(module.training == training for module in replacement.modules())
    shared = {**dict(replacement.named_parameters()), **dict(replacement.named_buffers())}
    assert sorted(shared) == sorted(f"module.{name}" for name in original_tensors)
    for name, tensor in original_tensors.items():
        assert shared[f"module.{name}"] is tensor, name  # the same Parameter / buffer object ...
        assert shared[f"module.{name}"].data_ptr() == tensor.data_ptr(), name  # ... so the same storage
    assert torch.equal(net(x, mask), expected)
    with torch.no_grad():
        original.down.bias.add_(1.0)  # an update of the model's weights is what the swapped module computes with
    torch.testing.assert_close(net(x, mask), expected + 0.5 * mask * net.layer.scale)


def test_a_model_new_whose_constructor_cannot_run_on_meta_tensors_is_built_on_the_cpu(tmp_path, user_package):
    net, problem = captured_mlp(user_package, tmp_path)
    base = model_new_class(problem)

    class ReadsAValue(base):
        def __init__(self):
            super().__init__()
            self.threshold = self.module.down.bias.detach().abs().max().item()  # .item() has no meta value

    original = net.mlp
    replacement = swap_module(net, "mlp", ReadsAValue)
    assert net.mlp is replacement and replacement.module.down.weight is original.down.weight
    assert replacement.threshold == original.down.bias.detach().abs().max().item()


def test_swap_refuses_what_does_not_fit_in_one_sentence(tmp_path, user_package):
    net, problem = captured_mlp(user_package, tmp_path)
    model_new = model_new_class(problem)
    refusals = [
        (lambda: swap_module(net, "mlp.nothing", model_new), "has no submodule 'mlp.nothing'"),
        (lambda: swap_module(net, "", model_new), "needs the name of a submodule"),
        (lambda: swap_module(net, "layer", model_new), "are not those of 'layer'"),
        (lambda: swap_module(net.double(), "mlp", model_new),
         r"mlp.shift is \(16,\) float64, and the workspace's kernels were made for \(16,\) float32"),
    ]  # fmt: skip
    for swap_call, message in refusals:
        with pytest.raises(DeployError, match=message) as refused:
            swap_call()
        assert refused.value.hint
        assert type(net.mlp).__name__ == "GatedMLP", "a refused swap leaves the model as it was"


def test_swap_refuses_a_model_new_keeping_a_tensor_it_cannot_share(tmp_path, user_package):
    net, problem = captured_mlp(user_package, tmp_path)

    class KeepsATable(model_new_class(problem)):
        def __init__(self):
            super().__init__()
            self.table = torch.ones(4)  # a plain attribute: no name to share it by

    with pytest.raises(DeployError, match=r"keeps tensors outside its parameters and buffers \(table\)"):
        swap_module(net, "mlp", KeepsATable)


# --------------------------------------------------------------------- an accepted build, a fresh process


# What the accepted stand-in kernel adds to x * scale: well inside the judge's tolerance, and the swapped output
# shows that the built kernel computed it.
KERNEL_OFFSET = 1e-4
LOAD_AND_SWAP = """
    import inspect, json, sys, torch, kernelpilot
    sys.path.insert(0, {src!r})  # the user's project, as their own script would have it
    from {package}.layers import Net
    from kernelpilot.errors import KernelpilotError

    torch.manual_seed(0)
    net = Net(features=1024).eval()
    x = torch.randn(256, 1024)
    expected = net.layer(x)
    try:
        new = kernelpilot.swap(net, "layer", {workspace!r})
    except KernelpilotError as err:
        print(json.dumps({{"error": err.message, "hint": err.hint}}))
        raise SystemExit(3)
    with torch.no_grad():  # inference: the kernels have no backward
        swapped = net.layer(x)
    try:
        net.layer(x)  # the weights require grad: a call outside no_grad must refuse, not give a silent wrong grad
        refused = ""
    except RuntimeError as err:
        refused = str(err)
    print(json.dumps({{
        "refused_with_grad": refused,
        "class": type(new).__name__,
        "source": inspect.getsourcefile(type(new)),
        "kernel_offset": (swapped - expected).mean().item(),
        "close": torch.allclose(swapped, expected + {offset!r}, atol=1e-6, rtol=0),
        "shared": new.module.scale.data_ptr() == net.layer.module.scale.data_ptr() and new.module.scale.requires_grad,
        "training": net.layer.training,
    }}))
"""


@pytest.mark.cuda_build
def test_an_accepted_workspace_loads_and_swaps_in_a_fresh_process_in_another_folder(tmp_path, user_package):
    torch.manual_seed(0)
    net = user_package.Net(features=1024)
    with kernelpilot.capture(net.layer, tmp_path / "project" / "problems" / "scale.py"):
        net.layer(torch.randn(256, 1024))
    env = {**os.environ, "KERNELPILOT_CACHE_DIR": str(run_cache_dir(tmp_path)), "PYTHONPATH": str(REPO_ROOT / "src")}
    env.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")  # no GPU says which: the C++ stand-in kernel needs none anyway
    project = tmp_path / "project"
    ws, _ = init_workspace(project / "problems" / "scale.py", project / "kp-scale", device="cpu")
    for example in EXAMPLE_KERNELS:
        (ws.root / example).unlink()
    binding = ws.kernels_dir / "scale_mul_binding.cpp"
    binding.write_text(scale_mul_binding(offset=KERNEL_OFFSET))
    ws.model_new_path.write_text(textwrap.dedent(SCALE_MUL_MODEL_NEW))
    accept = [sys.executable, "-m", "kernelpilot", "accept", str(ws.root), "--device", "cpu", "--no-commit",
              "--trials", "2"]
    accepted = subprocess.run(accept, env=env, capture_output=True, text=True, timeout=900)
    assert accepted.returncode == 0, accepted.stdout[-3000:] + accepted.stderr[-3000:]
    assert read_lock(ws.root / LOCK_NAME).files["kernels/scale_mul_binding.cpp"]

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    package = user_package.__name__.split(".")[0]
    script = textwrap.dedent(LOAD_AND_SWAP).format(src=str(project / "src"), package=package, workspace=str(ws.root),
                                                    offset=KERNEL_OFFSET)  # fmt: skip

    def run_fresh() -> tuple[int, dict]:
        done = subprocess.run([sys.executable, "-c", script], cwd=elsewhere, env=env, capture_output=True, text=True,
                              timeout=600)  # fmt: skip
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
        return done.returncode, json.loads(done.stdout.strip().splitlines()[-1])

    code, swapped = run_fresh()
    assert code == 0, swapped
    assert swapped.pop("kernel_offset") == pytest.approx(KERNEL_OFFSET, rel=1e-2)
    assert "has no backward yet" in swapped.pop("refused_with_grad")
    assert swapped == {"class": "ModelNew", "source": str(ws.model_new_path), "close": True, "shared": True,
                       "training": False}  # fmt: skip

    binding.write_text(scale_mul_binding(offset=1.0))  # edited after accept: not what was verified
    code, refused = run_fresh()
    assert code == 3
    assert refused["error"] == (
        f"The candidate in {ws.root} changed since it was accepted (kernels/scale_mul_binding.cpp), so a build of it "
        "is not what was verified."
    )


# ------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_policy_kernels_swapped_into_a_model_give_its_output(tmp_path, monkeypatch):
    """Capture an RMSNorm and a SwiGLU MLP of a small TinyGPT on the GPU, optimize them with the built-in policy,
    accept them, swap them into every block: the model's output is the original's."""
    monkeypatch.syspath_prepend(str(EXAMPLES / "models"))
    from tiny_gpt import GPTConfig, RMSNorm, TinyGPT

    torch.manual_seed(0)
    config = GPTConfig(dim=512, heads=8, layers=2, mlp_hidden=1408)
    with torch.device("cuda"):
        model = TinyGPT(config).eval()
        for module in model.modules():
            if isinstance(module, RMSNorm):
                nn.init.uniform_(module.weight, 0.5, 1.5)
        x = torch.randn(4, 256, config.dim)
    with torch.inference_mode():
        expected = model(x)
    problems = {"norm": tmp_path / "problems" / "norm.py", "mlp": tmp_path / "problems" / "mlp.py"}
    with torch.inference_mode(), kernelpilot.capture(model.blocks[0].mlp_norm, problems["norm"]), \
            kernelpilot.capture(model.blocks[0].mlp, problems["mlp"]):  # fmt: skip
        model(x)
    env = {**os.environ, "KERNELPILOT_CACHE_DIR": str(tmp_path / "cache")}
    for name, problem in problems.items():
        ws = tmp_path / f"kp-{name}"
        for command in (["optimize", str(problem), "--dir", str(ws), "--output", str(ws / "model_new.py"),
                         "--max-turns", "12"], ["accept", str(ws), "--no-commit"]):  # fmt: skip
            done = subprocess.run([sys.executable, "-m", "kernelpilot", *command], env=env, capture_output=True,
                                  text=True, timeout=900)  # fmt: skip
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    norms = [name for name, module in model.named_modules() if isinstance(module, RMSNorm)]
    weights = {name: model.get_submodule(name).weight for name in norms}
    for name in norms:
        kernelpilot.swap(model, name, tmp_path / "kp-norm")
    for index in range(config.layers):
        kernelpilot.swap(model, f"blocks.{index}.mlp", tmp_path / "kp-mlp")
    assert all(model.get_submodule(name).module.weight is weights[name] for name in norms)
    with torch.inference_mode():
        swapped = model(x)
    torch.testing.assert_close(swapped, expected, atol=1e-2, rtol=1e-2)
