#!/usr/bin/env python3
"""End-to-end: malformed checkpoints and out-of-range flags stop the command with a one-line error
naming the file, field or flag, never a crash, a hang or a silently different answer.

Each case copies the demo model (models/demo) into a temporary folder, breaks one thing and runs
the real command; it must exit non-zero within the timeout (no signal), and the last stderr line
must start with "moeinfer: error:" (CLI11's own refusals: "--flag: ...") and hold every needle.

  eos_token_id_wraps          config.json eos_token_id 4294971389 (4093 + 2^32) or -5: refused
                              naming the field; it was kept as int64 and compared as int32, so
                              generation stopped at token 4093
  tensor_in_two_shards        a model.safetensors.index.json whose shards both hold one tensor:
                              refused naming the tensor and both shards (one copy was taken)
  plan_out_of_range           plan --gpu-mem inf (printed a negative token count), --gpus 2^40,
                              --max-seq-len -5 (taken as the model's context),
                              --gpu-memory-fraction 1.5: refused naming the flag
  ep_zero                     --ep 0 refused as "not in range 1 to ..." (it read "0 not in range
                              0 to 1.79e308")
  bench_negative_step_budget  bench --max-num-batched-tokens -5 refused (taken as 0, every prompt
                              in one step)
  text_file_is_a_folder       eval --text-file DIR refused as a folder (it was read as empty text:
                              "encodes to 1 token(s): nothing to score"), as expert-load's
                              CLI::ExistingFile already refuses it
  token_id_lists              logits --ids 1,2, (a trailing comma was taken) and tokenize
                              --decode 99999999 (an id past the vocabulary decoded to nothing, exit
                              0) or -5: refused naming the flag
  unwritable_output           bench/eval --json and logits --out into a missing folder or onto a
                              folder: refused when the command line is read, not after the run
  weights_scope_needs_format  --weights-scope linear without --weights fp8|int4 (none, or bf16)
                              refused by generate, logits, eval and bench naming both flags;
                              --weights-scope all refused by CLI11 naming the flag

Prints one line per check and a last line "N passed, M failed".
"""

from __future__ import annotations

import json
import pathlib
import shutil
import struct
import subprocess
import sys
import tempfile

import e2e_util

TIMEOUT = 120


def refused(moeinfer: str, args: list[str], *needles: str) -> str:
    """Runs `moeinfer ARGS`; it must fail cleanly with every needle in its last stderr line."""
    r = subprocess.run([moeinfer, *args], capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode > 0, f"{args}: exit {r.returncode} (0 or a signal): {r.stderr[-1000:]}"
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines, f"{args}: exit {r.returncode} with nothing on stderr"
    error = "\n".join(lines[-2:])  # CLI11 prints its error, then "Run with --help ..."
    for needle in needles:
        assert needle in error, f"{args}: {needle!r} not in {error!r}"
    return error


def read_safetensors(path: pathlib.Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def write_safetensors(path: pathlib.Path, header: dict, body: bytes) -> None:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + body)


def main() -> int:
    args = e2e_util.parse_args(__doc__)
    moeinfer = args.moeinfer
    demo = e2e_util.demo_model(args.fixtures)
    tmp = tempfile.TemporaryDirectory(prefix="moe_bad_input_")
    root = pathlib.Path(tmp.name)

    def copy(name: str) -> pathlib.Path:
        folder = root / name
        shutil.copytree(demo, folder)
        return folder

    def edit_config(folder: pathlib.Path, **fields) -> None:
        path = folder / "config.json"
        config = json.loads(path.read_text())
        config.update(fields)
        path.write_text(json.dumps(config))

    def check_eos_token_id_wraps() -> None:
        for value in (4093 + 2**32, -5):
            folder = copy(f"eos_{value}")
            edit_config(folder, eos_token_id=[value, 4095])
            for command in (["generate", "--model", str(folder), "--prompt", "Hello",
                             "--max-tokens", "3"], ["info", "--model", str(folder)]):
                refused(moeinfer, command, "moeinfer: error:", "config.json",
                        "'eos_token_id'", str(value))

    def check_tensor_in_two_shards() -> None:
        folder = copy("two_shards")
        header, body = read_safetensors(folder / "model.safetensors")
        (folder / "model.safetensors").unlink()
        names = [k for k in header if k != "__metadata__"]
        shards = {"a.safetensors": names[: len(names) // 2],
                  "b.safetensors": names[len(names) // 2:] + [names[0]]}  # names[0] in both
        weight_map = {}
        for shard, members in shards.items():
            part, blob = {}, b""
            for name in members:
                begin, end = header[name]["data_offsets"]
                part[name] = dict(header[name], data_offsets=[len(blob), len(blob) + end - begin])
                blob += body[begin:end]
                weight_map.setdefault(name, shard)
            write_safetensors(folder / shard, part, blob)
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}))
        refused(moeinfer, ["generate", "--model", str(folder), "--prompt", "Hello",
                           "--max-tokens", "2"],
                "moeinfer: error:", "model.safetensors.index.json", f"'{names[0]}'",
                "two shards, a.safetensors and b.safetensors")

    def check_plan_out_of_range() -> None:
        plan = ["plan", "--model", str(demo)]
        refused(moeinfer, [*plan, "--gpu-mem", "inf"], "moeinfer: error:", "--gpu-mem")
        refused(moeinfer, [*plan, "--gpu-mem", "1e30"], "moeinfer: error:", "--gpu-mem")
        refused(moeinfer, [*plan, "--gpus", str(2**40)], "moeinfer: error:", "--gpus")
        refused(moeinfer, [*plan, "--max-seq-len", "-5"], "moeinfer: error:", "--max-seq-len")
        refused(moeinfer, [*plan, "--gpu-memory-fraction", "1.5"], "moeinfer: error:",
                "--gpu-memory-fraction")
        ok = subprocess.run([moeinfer, *plan, "--gpus", "8", "--gpu-mem", "192"],
                            capture_output=True, text=True, timeout=TIMEOUT)
        assert ok.returncode == 0, ok.stderr

    def check_ep_zero() -> None:
        refused(moeinfer, ["generate", "--model", str(demo), "--prompt", "Hello", "--ep", "0"],
                "--ep", "not in range 1 to")

    def check_bench_negative_step_budget() -> None:
        refused(moeinfer, ["bench", "--model", str(demo), "--batch", "1", "--input-len", "4",
                           "--output-len", "2", "--max-num-batched-tokens", "-5"],
                "moeinfer: error:", "--max-num-batched-tokens", "-5")

    def check_text_file_is_a_folder() -> None:
        refused(moeinfer, ["eval", "--model", str(demo), "--text-file", str(root)],
                "moeinfer: error:", "--text-file", "is a folder")
        refused(moeinfer, ["expert-load", "--model", str(demo), "--text-file", str(root)],
                "--text-file", "directory")

    def check_token_id_lists() -> None:
        refused(moeinfer, ["logits", "--model", str(demo), "--ids", "1,2,", "--out",
                           str(root / "x.npy")], "moeinfer: error:", "--ids", "not a token id")
        for ids in ("99999999", "-5"):
            refused(moeinfer, ["tokenize", "--model", str(demo), "--decode", ids],
                    "moeinfer: error:", "--decode", ids)

    def check_unwritable_output() -> None:
        missing = str(root / "no-such-folder" / "out.json")
        refused(moeinfer, ["bench", "--model", str(demo), "--batch", "1", "--input-len", "4",
                           "--output-len", "2", "--json", missing], "--json", "no folder")
        refused(moeinfer, ["eval", "--model", str(demo), "--text-file",
                           str(demo / "config.json"), "--json", str(root)], "--json", "is a folder")
        refused(moeinfer, ["logits", "--model", str(demo), "--ids", "1,2", "--out", missing],
                "--out", "no folder")

    def check_weights_scope_needs_format() -> None:
        runs = {
            "generate": ["generate", "--model", str(demo), "--prompt", "Hello",
                         "--max-tokens", "2"],
            "logits": ["logits", "--model", str(demo), "--ids", "1,2", "--out",
                       str(root / "x.npy")],
            "eval": ["eval", "--model", str(demo), "--text-file", str(demo / "config.json")],
            "bench": ["bench", "--model", str(demo), "--batch", "1", "--input-len", "4",
                      "--output-len", "2"],
        }
        for name, run in runs.items():
            for weights in ([], ["--weights", "bf16"]):
                refused(moeinfer, [*run, *weights, "--weights-scope", "linear"],
                        "moeinfer: error:", "--weights-scope linear", "--weights fp8")
        refused(moeinfer, [*runs["generate"], "--weights", "fp8", "--weights-scope", "all"],
                "--weights-scope")

    checks = e2e_util.selected(
        [check_eos_token_id_wraps, check_tensor_in_two_shards, check_plan_out_of_range,
         check_ep_zero, check_bench_negative_step_budget, check_text_file_is_a_folder,
         check_token_id_lists, check_unwritable_output, check_weights_scope_needs_format],
        args.only)
    result = e2e_util.summary(*e2e_util.run_checks(checks))
    tmp.cleanup()
    return result


if __name__ == "__main__":
    sys.exit(main())
