"""`lowrank-jax compress MODEL --plan irregular.json --plots DIR` on a converted DeiT ("Vision
Transformer with Irregular Attention"): per-block ranks per head, parameter/FLOP ratios and
errors in the report (checked against the plan applied in-process, the saved checkpoint's array
sizes, a hand FLOP count and a PyTorch/NumPy forward of the block), the layer x head heat map,
and the --plots output rules."""

import json
import math
import os

import jax
import numpy as np
import pytest

import lowrank_jax as lj
from lowrank_jax.cli.main import main
from lowrank_jax.compress import head_ranks
from lowrank_jax.io import load_model
from lowrank_jax.leaves import BTDQueryKey, get_path

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

F, H, D, N, LAYERS = 16, 2, 8, 6, 2  # 16x16 image, 8x8 patches: 4 patches + cls + distillation
RATIO, VO = 0.7, 4
PLAN = {"steps": [
    {"method": "btd", "rules": ["attn/qk$"],
     "settings": {"flops_ratio": RATIO, "n_tokens": N, "vo_rank": VO}},
    {"method": "truncatt_vo", "rules": ["attn/v$"], "settings": {"rank": VO}},
]}


@pytest.fixture(scope="module")
def deit(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.DeiTConfig(image_size=16, patch_size=8, num_channels=1, hidden_size=F,
                                  num_hidden_layers=LAYERS, num_attention_heads=H,
                                  intermediate_size=32, num_labels=3)
    model = transformers.DeiTForImageClassificationWithTeacher(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():  # O(1) weights and non-zero q/k biases
            is_scale = p.ndim == 1 and "norm" in name.lower() and name.endswith("weight")
            p.copy_(1.0 + 0.1 * torch.randn(p.shape) if is_scale else 0.3 * torch.randn(p.shape))
    model.eval()
    root = tmp_path_factory.mktemp("deit")
    model.save_pretrained(root / "hf")
    assert main(["convert", str(root / "hf"), "--out", str(root / "native"), "--no-progress"]) == 0
    plan = root / "irregular.json"
    plan.write_text(json.dumps(PLAN))
    return model, root / "native", plan


def hand_macs(ranks, vo):
    """Executed multiply-adds of one block on N tokens: q/k projections to sum(L) rank-1
    coordinates, the zero-padded terms (N^2 T max L), the head fusion (N^2 H T), v/o at the
    value widths and the weighted sum of values (N^2 H max v)."""
    t = len(ranks)
    return (2 * N * F * sum(ranks) + N * N * t * max(ranks) + N * N * H * t
            + 2 * N * F * sum(vo) + N * N * H * max(vo))


def numpy_block(block, x):
    """The compressed block's output in float64 NumPy from its arrays."""
    qk, v, o = block["qk"], block["v"], block["o"]
    a = lambda leaf: np.asarray(leaf, np.float64)  # noqa: E731
    q, k = x @ a(qk.q.w) + a(qk.q.b), x @ a(qk.k.w) + a(qk.k.b)
    off = np.cumsum([0, *qk.ranks])
    terms = np.stack([q[..., off[t]:off[t + 1]] @ np.swapaxes(k[..., off[t]:off[t + 1]], -1, -2)
                      for t in range(len(qk.ranks))], 1)  # [b, T, N, N]
    logits = np.einsum("ht,btqk->bhqk", a(qk.mix), terms) / math.sqrt(D)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    vals = x @ a(v.w) + a(v.b)
    voff = np.cumsum([0, *block["heads"].v])
    heads = [p[:, h] @ vals[..., voff[h]:voff[h + 1]] for h in range(H)]
    return np.concatenate(heads, -1) @ a(o.w) + a(o.b)


def test_compress_plan_reports_ranks_ratios_errors_and_plots(deit, tmp_path, capsys):
    model, native, plan = deit
    js, plots, small = tmp_path / "rep.json", tmp_path / "plots", tmp_path / "small"
    assert main(["compress", str(native), "--plan", str(plan), "--plots", str(plots), "--json",
                 str(js), "--out", str(small), "--time-runs", "1", "--no-progress"]) == 0
    stdout = capsys.readouterr().out
    rep = json.loads(js.read_text())
    blocks = rep["attention_blocks"]
    assert [b["path"] for b in blocks] == [f"encoder/layers/{i}/attn" for i in range(LAYERS)]

    # the total rank: the largest R whose block MACs by the paper's formulas stay within 0.7
    dense = 2 * N * D * H * (2 * F + N)
    paper = [(N * r * (2 * F + N) + N * N * H * H + N * VO * H * (2 * F + N)) / dense
             for r in range(2 * D + 1)]
    total = max(r for r in range(2 * D + 1) if paper[r] <= RATIO)
    # the ranks per head are those of the same plan applied in-process, and of the saved model
    _, params = load_model(native)
    _, saved = load_model(small)
    _, rep_in = lj.apply_plan(params, lj.Plan.from_file(plan), key=jax.random.PRNGKey(0))
    in_process = head_ranks(rep_in)
    rows = {r["path"]: r for r in rep["rows"] if r["kind"] == "btd"}
    for b in blocks:
        qk_path = b["path"] + "/qk"
        assert b["method"] == "btd"
        assert b["head_ranks"] == in_process[qk_path] == rows[qk_path]["details"]["head_ranks"]
        node = get_path(saved, qk_path)
        assert isinstance(node, BTDQueryKey) and list(node.ranks) == b["head_ranks"]
        assert sum(b["head_ranks"]) == total and max(b["head_ranks"]) <= D
        assert b["paper_flops_ratio"] == pytest.approx(paper[total], abs=1e-12)
        # parameter ratio from the arrays' sizes (before: the converted checkpoint)
        sizes = [sum(np.size(x) for x in jax.tree_util.tree_leaves(
            {k: get_path(tree, b["path"])[k] for k in ("qk", "v", "o")})) for tree in (params, saved)]
        assert (b["params_before"], b["params_after"]) == tuple(sizes)
        assert b["params_ratio"] == pytest.approx(sizes[1] / sizes[0], abs=1e-12)
        # executed FLOPs on N tokens, counted by hand
        assert b["n_tokens"] == N
        assert b["macs_before"] == 4 * N * F * F + 2 * N * N * H * D
        assert b["macs_after"] == hand_macs(b["head_ranks"], [VO] * H)
        assert 0 < b["tensor_error"] < 1
    # the block output error: the original block in PyTorch, the compressed one in NumPy, on the
    # report's sample tokens (seed 0, one draw of [2, N, F] per block, in order)
    rng = np.random.default_rng(0)
    layers = getattr(model.deit, "layers", None) or model.deit.encoder.layer  # transformers 5 / 4
    for i, b in enumerate(blocks):
        x = rng.standard_normal((2, N, F)).astype(np.float32)
        with torch.no_grad():
            ref = layers[i].attention(torch.from_numpy(x))[0].numpy()
        got = numpy_block(get_path(saved, b["path"]), x.astype(np.float64))
        want = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert b["output_error"] == pytest.approx(want, abs=1e-5)
        assert b["output_error"] > 1e-3  # rank 13 of 16 with VO rank 4 is not exact
    assert 0 < rep["model"]["rel_error"] < 1
    # the printed table: one line per block with its ranks per head
    assert "attention blocks" in stdout
    for b in blocks:
        line = next(ln for ln in stdout.splitlines() if ln.startswith(b["path"] + " "))
        assert ",".join(map(str, b["head_ranks"])) in line and "btd" in line
    # the heat map, in a marked plots directory
    png = plots / "head_ranks.png"
    assert rep["plots"] == [str(png)]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    marker = json.loads((plots / "lowrank_jax_output.json").read_text())
    assert marker["kind"] == "plots" and marker["files"] == ["head_ranks.png"]
    # a second run replaces the plots only with --overwrite
    assert main(["compress", str(native), "--plan", str(plan), "--plots", str(plots),
                 "--no-eval", "--no-progress"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(["compress", str(native), "--plan", str(plan), "--plots", str(plots),
                 "--no-eval", "--no-progress", "--overwrite"]) == 0
    assert sorted(os.listdir(plots)) == ["head_ranks.png", "lowrank_jax_output.json"]


def test_plots_refused_before_any_work(deit, tmp_path, capsys):
    _, native, plan = deit
    plots = tmp_path / "plots"
    # no plan, or a plan without a query-key method: nothing to draw
    assert main(["compress", str(native), "--rank", "2", "--plots", str(plots), "--no-eval",
                 "--no-progress"]) == 2
    assert "--plots" in capsys.readouterr().err
    svd = tmp_path / "svd.json"
    svd.write_text(json.dumps({"steps": [{"method": "svd", "rules": ["attn/v$"],
                                          "settings": {"rank": 2}}]}))
    assert main(["compress", str(native), "--plan", str(svd), "--plots", str(plots), "--no-eval",
                 "--no-progress"]) == 2
    assert "has none" in capsys.readouterr().err
    assert not plots.exists()
    # a directory the tool did not write is never replaced, an input never written into
    plots.mkdir()
    (plots / "notes.txt").write_text("mine")
    for target in (plots, native / "plots"):
        assert main(["compress", str(native), "--plan", str(plan), "--plots", str(target),
                     "--no-eval", "--no-progress", "--overwrite"]) == 2
    assert sorted(os.listdir(plots)) == ["notes.txt"] and not (native / "plots").exists()
    # the report may not go inside the plots directory
    assert main(["compress", str(native), "--plan", str(plan), "--plots", str(tmp_path / "p2"),
                 "--json", str(tmp_path / "p2" / "rep.json"), "--no-eval", "--no-progress"]) == 2
    assert "inside the output directory" in capsys.readouterr().err
