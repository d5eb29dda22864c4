"""`kernelpilot.capture`: the problem file a submodule's first call becomes loads with problem.py and its Model
reproduces the module, its class imported from a user's package that only the capturing process has on its
path; keywords, plain values and tuples of tensors; integer and boolean inputs; refusals that leave nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import kernelpilot
from kernelpilot.problem import load_problem
from kernelpilot.problem_capture import CaptureError

from kp_testing import REPO_ROOT


def captured_net(user_package, problem_path):
    """The user's Net, its MLP captured into `problem_path` while the Net runs; (net, inputs, output, capture)."""
    torch.manual_seed(0)
    net = user_package.Net()
    x, mask = torch.randn(4, 16), torch.rand(4, 16)
    with kernelpilot.capture(net.mlp, problem_path) as captured:
        output = net.mlp(x, mask, mode="residual")
        net(x, mask)  # a second call of the module, which writes nothing
    return net, (x, mask), output, captured


def test_a_captured_problem_loads_and_its_model_reproduces_the_module_on_the_captured_inputs(tmp_path, user_package):
    path = tmp_path / "problems" / "mlp.py"
    net, inputs, output, captured = captured_net(user_package, path)

    problem = load_problem(path)  # validated as `init` does: Model() and get_inputs() on meta tensors
    model = problem.make_model()
    assert torch.equal(model(*inputs), output)
    assert str(problem.forward_signature()) == "(x, mask, mode='residual')"
    assert problem.init_inputs == []
    assert [(t.shape, t.dtype) for t in problem.make_inputs()] == [(t.shape, t.dtype) for t in inputs]
    assert model.module.scale == 0.5, "a constructor argument kept only as an attribute comes back"
    assert torch.equal(model.module.shift, net.mlp.shift), "a non-persistent buffer comes back too"
    for name, tensor in net.mlp.state_dict().items():
        assert torch.equal(model.module.state_dict()[name], tensor), name
    assert captured.result.problem == path and captured.result.module_file == path.with_suffix(".pt")
    assert captured.result.class_path == f"{user_package.__name__}.GatedMLP"
    assert captured.result.import_roots == [str(tmp_path / "project" / "src")]
    assert sorted(p.name for p in path.parent.iterdir()) == ["mlp.pt", "mlp.py"], "no partial file is left"


def test_the_problem_loads_and_passes_the_init_check_in_a_process_without_the_users_package(tmp_path, user_package):
    path = tmp_path / "problems" / "mlp.py"
    _, inputs, output, _ = captured_net(user_package, path)
    torch.save({"inputs": inputs, "output": output}, tmp_path / "expected.pt")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    script = f"""
        import importlib.util, torch
        from kernelpilot.problem import load_problem
        from kernelpilot.problem_check import check_problem
        assert importlib.util.find_spec({user_package.__name__.split(".")[0]!r}) is None, "the package is importable"
        expected = torch.load({str(tmp_path / "expected.pt")!r})
        model = load_problem({str(path)!r}).make_model()
        assert torch.equal(model(*expected["inputs"]), expected["output"])
        check = check_problem({str(path)!r}, device="cpu")  # what `kernelpilot init` runs, in a child with limits
        print("checked", check.signatures.forward_signature)
    """
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "src"), "KERNELPILOT_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "checked (self, x, mask, mode='residual')" in done.stdout


class Mixer(nn.Module):
    def forward(self, x, pair, *extra, scale=1.0, name="a", dtype=torch.float32, **options):
        total = x + pair[0] * pair[1] + sum(extra[:1]) * extra[1]
        return (total * scale).to(dtype) * (2 if options.get("flag") else 1) * len(name)


def test_keywords_plain_values_and_tuples_of_tensors_become_forward_parameters(tmp_path):
    x, a, b, c = (torch.randn(3, 5) for _ in range(4))
    mixer = Mixer()
    path = tmp_path / "mixer.py"
    with kernelpilot.capture(mixer, path):
        output = mixer(x, (a, b), c, 2.5, scale=0.5, name="bb", dtype=torch.float64, flag=True)

    problem = load_problem(path)
    assert str(problem.forward_signature()) == (
        "(x, pair_0, pair_1, extra_0, extra_1=2.5, scale=0.5, name='bb', dtype=torch.float64, flag=True)"
    )
    assert "self.module(x, (pair_0, pair_1), extra_0, extra_1, scale=scale, name=name, dtype=dtype, flag=flag)" in (
        path.read_text()
    )
    assert torch.equal(problem.make_model()(x, a, b, c), output)
    assert len(problem.make_inputs()) == 4


class ScaleFirst(nn.Module):
    def forward(self, scale, x):
        return x * scale


def test_a_plain_value_passed_before_a_tensor_becomes_keyword_only_so_passing_it_positionally_fails(tmp_path):
    module, x = ScaleFirst(), torch.randn(8)
    with kernelpilot.capture(module, tmp_path / "scale_first.py"):
        module(3.0, x)

    problem = load_problem(tmp_path / "scale_first.py")
    assert str(problem.forward_signature()) == "(x, *, scale=3.0)"
    model = problem.make_model()
    assert torch.equal(model(x), x * 3.0)
    with pytest.raises(TypeError):
        model(3.0, x)  # the tensors would shift by one: refused, not computed


class Lookup(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(64, 8)

    def forward(self, ids, keep):
        return self.table(ids) * keep.unsqueeze(-1)


def test_integer_inputs_are_drawn_in_the_captured_range_and_booleans_about_as_often_true(tmp_path):
    lookup = Lookup()
    ids = torch.arange(4 * 16).reshape(4, 16) % 38 + 3  # 3 ... 40
    keep = torch.zeros(4, 16, dtype=torch.bool)
    keep[:, :4] = True
    with kernelpilot.capture(lookup, tmp_path / "lookup.py"):
        lookup(ids, keep)

    source = (tmp_path / "lookup.py").read_text()
    assert "torch.randint(3, 41, (4, 16), dtype=torch.int64)" in source
    assert "torch.rand((4, 16)) < 0.25" in source
    problem = load_problem(tmp_path / "lookup.py")
    drawn_ids, drawn_keep = problem.make_inputs(seed=1)
    assert drawn_ids.dtype == torch.int64 and 3 <= drawn_ids.min() and drawn_ids.max() <= 40
    assert drawn_keep.dtype == torch.bool and 0 < drawn_keep.float().mean() < 0.6
    problem.make_model()(drawn_ids, drawn_keep)  # valid indices for the captured table


def test_used_as_a_decorator_it_captures_the_first_call_only(tmp_path):
    linear = nn.Linear(8, 8)
    path = tmp_path / "linear.py"

    @kernelpilot.capture(linear, path)
    def step(x):
        return linear(x)

    step(torch.randn(2, 8))
    step(torch.randn(5, 8))
    assert [t.shape for t in load_problem(path).make_inputs()] == [torch.Size([2, 8])]


# ----------------------------------------------------------------------------------------------- refusals


def make_local_module() -> nn.Module:
    class Local(nn.Module):
        def forward(self, x):
            return x + 1

    return Local()


class TakesAnything(nn.Module):
    def forward(self, x, options=None):
        return x


@pytest.mark.parametrize(
    ("module", "call", "message"),
    [
        (make_local_module(), lambda m: m(torch.randn(2)), "cannot be saved with torch.save"),
        (TakesAnything(), lambda m: m(torch.randn(2), options=object()), "`options` of the captured .* is an object"),
        (TakesAnything(), lambda m: None, "TakesAnything was not called inside the capture"),
        (TakesAnything(), lambda m: m.forward(torch.randn(2)), "was not called inside the capture"),
        (ScaleFirst(), lambda m: m(2.0, 3.0), "passed no tensor"),
    ],
    ids=["local-class", "object-argument", "never-called", "forward-called-directly", "no-tensor"],
)  # fmt: skip
def test_what_cannot_be_written_down_is_refused_in_a_sentence_and_leaves_nothing(tmp_path, module, call, message):
    problems = tmp_path / "problems"
    with pytest.raises(CaptureError, match=message) as refused:
        with kernelpilot.capture(module, problems / "p.py"):
            call(module)
    assert refused.value.hint
    assert not problems.exists(), "the folder made for the problem is removed again"


@pytest.mark.parametrize(
    ("arguments", "message"),
    [((object(), "p.py"), "takes an nn.Module, not an object"), ((nn.ReLU(), "p.txt"), "does not end in .py")],
)
def test_arguments_that_cannot_work_are_refused_before_anything_runs(tmp_path, arguments, message):
    module, name = arguments
    with pytest.raises(CaptureError, match=message):
        kernelpilot.capture(module, tmp_path / name)


def test_a_class_defined_in_the_script_being_run_is_refused(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch
        from torch import nn
        import kernelpilot
        from kernelpilot.problem_capture import CaptureError

        class Block(nn.Module):
            def forward(self, x):
                return x * 2

        block = Block()
        try:
            with kernelpilot.capture(block, "problems/block.py"):
                block(torch.randn(3))
        except CaptureError as err:
            print(err.message)
            print(err.hint)
    """))
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "src")}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Block is defined in the script being run (__main__), so a problem file cannot import it." in done.stdout
    assert "Move the model's classes into a module" in done.stdout
    assert not (tmp_path / "problems").exists()
