"""`fabric layout`: a config's vLLM layout for one rank, as JSON and as a table; bad input exits 2."""

from __future__ import annotations

import json

import weightfabric as wf
from weightfabric.tools.cli import main
from weightfabric.tools.command import EXIT_BAD_INPUT, EXIT_OK

QWEN2 = {"model_type": "qwen2", "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "tie_word_embeddings": True}


def test_json_lists_what_the_layout_binds_for_the_rank(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN2))
    assert main(["layout", "--config", str(path), "--tp", "2", "--rank", "1", "--json"]) == EXIT_OK
    out = json.loads(capsys.readouterr().out)
    layout = wf.vllm_layout(QWEN2, tp=2)
    assert out["layout"] == layout.name and out["key"] == layout.key and out["rank"] == 1
    names = {t["name"]: t for t in out["tensors"]}
    assert set(names) == {r.target for r in layout.rules}
    qkv = names["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv["shape"] == [(4 + 2 * 2) * 64 // 2, 256] and qkv["dtype"] == "bfloat16"
    assert qkv["sources"] == sorted(f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv")
    assert names["model.embed_tokens.weight"]["shape"] == [512, 256]   # 1000 padded to 1024, / 2


def test_the_table_and_fp8_scales(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**QWEN2, "hidden_size": 512, "intermediate_size": 1024,
                                "num_attention_heads": 4, "num_key_value_heads": 2}))
    assert main(["layout", "--config", str(path), "--tp", "2", "--fp8-block", "128"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "vllm-qwen2-tp2-fp8" in out and "float8_e4m3fn" in out and "weight_scale_inv" in out


def test_configs_that_do_not_fit_and_bad_files_exit_2(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN2))
    assert main(["layout", "--config", str(path), "--tp", "3"]) == EXIT_BAD_INPUT
    assert "tp=3" in capsys.readouterr().err
    assert main(["layout", "--config", str(tmp_path / "missing.json")]) == EXIT_BAD_INPUT
    path.write_text(json.dumps({**QWEN2, "model_type": "gpt2"}))
    assert main(["layout", "--config", str(path)]) == EXIT_BAD_INPUT
    assert "gpt2" in capsys.readouterr().err
