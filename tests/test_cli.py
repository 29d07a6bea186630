import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*args, **env):
    e = dict(os.environ, **env)
    e.pop("HAL_PLUGINS", None)
    return subprocess.run([sys.executable, "-m", "hal", *args], cwd=ROOT, env=e, capture_output=True, text=True,
                          timeout=600)


def test_info_lists_backends():
    r = run("info")
    assert r.returncode == 0 and "cpu" in r.stdout and "validation" in r.stdout


def test_conformance_cli_exit_codes():
    ok = run("conformance", "--backend", "cpu", "-k", "golden")
    assert ok.returncode == 0, ok.stdout[-2000:]
    bad = run("conformance", "--backend", "nonsense")
    assert bad.returncode == 2 and "registered" in bad.stderr


def test_demo_runs():
    r = run("demo", "--ops", HAL_BACKEND="cpu")
    assert r.returncode == 0 and "accepted 2/4" in r.stdout


def test_bench_prints_prometheus_metrics():
    r = run("bench", "--max-tokens", "8", "--k", "4", HAL_BACKEND="cpu")
    if "model not fetchable" in r.stderr or "could not be downloaded" in r.stderr:
        import pytest
        pytest.skip(r.stderr[-300:])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tok/s" in r.stdout and "TTFT P50" in r.stdout
    for name in ("spec_hal_acceptance_by_position", "spec_hal_acceptance_length_bucket",
                 "spec_hal_time_to_first_token_seconds_count 2.0", "spec_hal_time_per_output_token_seconds_bucket",
                 'spec_hal_latency_quantile_seconds{metric="e2e_request_latency",quantile="0.99"}'):
        assert name in r.stdout, name


def _refused(capsys, main, *argv):
    import pytest
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    return e.value.code, capsys.readouterr().err


def test_bad_serve_flags_exit_2_naming_the_flag_before_loading(capsys):
    """The outside trial: ``--model smollm2`` and ``--draft model:/nonexistent.gguf`` ended in
    raw tracebacks after loading, ``--k -1`` started and refused every request, ``--max-num-seqs
    0`` failed only after the model loaded. argparse refuses each now, before anything loads
    (nothing is fetched or planned: these return at once)."""
    from hal.server.app import main
    for argv, flag in ((["--model", "smollm2"], "--model"), (["--draft", "model:/nonexistent.gguf"], "--draft"),
                       (["--draft", "eagle:/nonexistent"], "--draft"), (["--k", "-1"], "--k"),
                       (["--max-num-seqs", "0"], "--max-num-seqs"), (["--port", "70000"], "--port"),
                       (["--draft-timeout", "nan"], "--draft-timeout"), (["--max-model-len", "x"], "--max-model-len"),
                       (["--memory-fraction", "0"], "--memory-fraction"), (["--draft", "bogus"], "--draft"),
                       (["--fanout", "-1"], "--fanout"), (["--fanout", "65"], "--fanout"),
                       (["--served-model-name", ""], "--served-model-name"), (["--draft", "self:0"], "--draft")):
        code, err = _refused(capsys, main, *argv)
        assert code == 2 and f"argument {flag}: expected" in err and "Traceback" not in err, (argv, err)
    assert "self:L with L a number of the target's layers >= 1" in _refused(capsys, main, "--draft", "self:0")[1]


def test_the_trials_low_items_are_refused_before_loading(capsys):
    """Issue 66's low items: ``generate --temperature inf`` failed only after the model loaded; a
    bad ``--host`` was reported as "--port ... in use"; ``--max-model-len 9000`` was accepted for a
    model trained to 8,192 (llama.context_length). Each is one line naming the flag, before any
    weight is read."""
    from hal.cli import main as cli
    from hal.server.app import main as serve
    from hal.launch.generate import main as launch
    for run in (lambda: cli(["generate", "--prompt", "hi", "--temperature", "inf"]),
                lambda: launch(["--model", "smollm2-135m", "--prompt-ids", "1,2", "--temperature", "inf"])):
        with pytest.raises(SystemExit) as e:
            run()
        err = capsys.readouterr().err
        assert e.value.code == 2 and "argument --temperature: expected a finite number, got inf" in err, err
    assert serve(["--host", "no-such-host.invalid", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "--host: expected an address or a host name of this machine" in err and "--port" not in err, err
    assert serve(["--host", "192.0.2.1", "--port", "0"]) == 2   # TEST-NET-1: not this machine's address
    err = capsys.readouterr().err
    assert "--host: expected an address of this machine" in err, err
    assert serve(["--port", "0", "--max-model-len", "9000"]) == 2
    err = capsys.readouterr().err
    assert "--max-model-len / --max-context: expected at most 8192 tokens" in err and "got 9000" in err, err
    assert "linear plan:" not in err and len(err.strip().splitlines()[-1]) < 300


def flags_without_help(text: str) -> list[str]:
    """The options of an argparse ``--help`` text that have no help line."""
    entries = re.split(r"\n  (?=-)", "\n" + text.split("options:", 1)[1])[1:]
    return [e.split()[0] for e in entries if len(e.strip().splitlines()) == 1 and "  " not in e.strip()]


def test_every_flag_has_help(capsys):
    import argparse
    import pytest
    from hal.cli import main as cli
    from hal.server.app import main as serve
    bare = argparse.ArgumentParser()
    bare.add_argument("--host")
    bare.add_argument("--port", help="the port")
    assert flags_without_help(bare.format_help()) == ["--host"]   # the check itself finds a bare flag
    for main, argv in ((serve, ["--help"]), (cli, ["generate", "--help"])):
        with pytest.raises(SystemExit):
            main(argv)
        assert not flags_without_help(capsys.readouterr().out), argv


def test_serve_on_port_0_prints_the_port_it_took(tmp_path):
    """``--port 0`` printed port 0; now the port the system chose. (A model without a tokenizer
    then ends start-up with exit 2 naming --model, after the port was taken and printed.)"""
    import json
    import torch
    from safetensors.torch import save_file
    from tests.launch.test_generate import FFN, H, HEADS, KV, LAYERS, V, hf_weights
    save_file(hf_weights(torch.Generator().manual_seed(1)), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(dict(
        model_type="llama", tie_word_embeddings=True,
        hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV,
        intermediate_size=FFN, vocab_size=V, rope_theta=10000.0, rms_norm_eps=1e-5)))
    r = run("serve", "--model", str(tmp_path), "--draft", "none", "--port", "0", "--dtype", "float32",
            HAL_BACKEND="cpu")
    port = re.search(r"listening on 127\.0\.0\.1:(\d+)", r.stderr + r.stdout)
    assert r.returncode == 2 and port and int(port.group(1)) > 0 and "--model" in r.stderr, r.stderr[-2000:]


def test_info_says_what_the_plan_did_not_use_and_why(monkeypatch, capsys):
    """`hal info`'s plan lists the self-check's drops and the families not measured (at most
    8 lines, then a count), so a user sees why e.g. float32 int4 rows were never timed."""
    import torch
    from hal import cli
    from hal.models import linear_plan as lp
    plan = lp.LinearPlan("mm", torch.bfloat16, (1, 2), weights="int4", head="q8_0")
    why = [f"float32 int4: not measured ({lp.FALLBACK_ONLY})"] + [f"bfloat16 float mm: width {n} dropped"
                                                                   for n in range(9)]
    heads = [{"head": "float", "ms": {1: 3.3, 5: 14.9, 9: 26.6}, "score": 12.0},
             {"head": "q8_0", "ms": {1: 4.2, 5: 10.0, 9: 15.9}, "score": 8.6}]
    choice = lp.Choice(plan, {"cpu": "x", "threads": 2}, [], why, heads=heads)
    asked = {}
    monkeypatch.setattr(lp, "choose_plan", lambda *a, **kw: asked.update(kw) or choice)
    cli.print_plan("smollm2-135m", "auto", False)
    out = capsys.readouterr().out
    assert asked["q8_head"], "the bundled model's Q8_0 head must be offered to the plan, as the loader offers it"
    assert f"not used: float32 int4: not measured ({lp.FALLBACK_ONLY})" in out
    assert out.count("not used: bfloat16 float mm") == 7 and "not used: 2 more" in out
    assert "lm_head Q8_0 as stored" in out
    assert re.search(r"lm_head q8_0  \(chosen\) +score +8\.6 ms", out) and re.search(r"lm_head float +score +12\.0", out)
    cli.print_plan("smollm2-135m", "auto", False, "float")   # pinned: the line says so, and marks it chosen
    out = capsys.readouterr().out
    assert "--lm-head float: int4 weights as stored (bfloat16 rows; other weights" in out
    assert re.search(r"lm_head float \(chosen\) +score +12\.0", out)
    choice.heads = []
    cli.print_plan("smollm2-135m", "auto", False, "stored")   # refused: said, not raised
    assert "--lm-head: expected an lm_head stored as Q8_0" in capsys.readouterr().out


def test_export_drafter_writes_the_eagle_head_and_refuses_a_folder_in_use(tmp_path, capsys):
    """``model export-drafter``: the shipped EAGLE-3 head as shipped (the DSpark one, with the
    target's copies: tests/drafters/test_shipped_layouts.py); a folder with files in it is
    refused in one line, nothing written, and so is a model with no shipped drafter."""
    from hal.cli import main
    from hal.models.eagle import shipped_head
    assert main(["model", "export-drafter", "eagle", "--out", str(tmp_path / "e")]) == 0
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "e" / name).read_bytes() == (shipped_head("smollm2-135m") / name).read_bytes()
    capsys.readouterr()
    assert main(["model", "export-drafter", "dspark", "--out", str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--out: expected a new or empty folder" in err and "Traceback" not in err
    assert sorted(p.name for p in (tmp_path / "e").iterdir()) == ["config.json", "model.safetensors"]
    (tmp_path / "other.gguf").write_bytes(b"")   # a model file of its own: nothing is shipped for it
    other = str(tmp_path / "other.gguf")
    assert main(["model", "export-drafter", "dspark", "--model", other, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--model: expected a model with a shipped dspark drafter, got {other!r}" in err
    assert not (tmp_path / "o").exists()
