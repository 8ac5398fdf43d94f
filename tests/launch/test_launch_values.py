"""Every value `olmax launch` writes into a job script, command line or manifest is checked: shell syntax in a
config field is refused (exit 2, one line, nothing written) or quoted so that the shell runs none of it. The
rendered scripts are run by bash in a scratch directory, with the cluster's commands as no-op shell functions
so that every line is reached: a payload that ran leaves a file named `pwned` there."""

import json
import re
import shlex
import shutil
import subprocess

import pytest
import yaml

from olmax.cli import main

PAYLOADS = ["a\necho > pwned", 'a"; echo > pwned; "', "$(echo > pwned)", "`echo > pwned`", "a; echo > pwned",
            "a' ; echo > pwned '", "a b"]
# The commands the scripts call, as functions that do nothing: bash still expands their arguments.
NO_OPS = "".join(f"{c}() {{ :; }}; " for c in ("srun", "scontrol", "python3", "setsid", "hostname"))


def _run_in_sandbox(tmp_path, script: str) -> None:
    sandbox = tmp_path / "sandbox"
    sandbox.mkdir(exist_ok=True)
    bash = shutil.which("bash")
    assert subprocess.run([bash, "-n", "-c", script]).returncode == 0, script
    subprocess.run([bash, "-c", NO_OPS + "\n" + script], cwd=sandbox, env={"PATH": str(tmp_path / "empty")},
                   capture_output=True)
    assert not (sandbox / "pwned").exists(), f"the script ran a payload:\n{script}"


DATA = 'data.paths=["gs://tokens/part-0.npy"]'  # a cluster job's preview refuses a config without data, as train does


def _launch(capsys, *argv) -> tuple[int, str, str]:
    argv = list(argv)
    if argv[0] in ("slurm", "k8s") and not any(arg.startswith("data.") for arg in argv):
        argv.insert(argv.index("tiny") + 1, DATA)
    code = main(["launch", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _refused(code, out, err, tmp_path):
    assert code == 2 and out == "", out
    [line] = err.splitlines()
    assert line.startswith("olmax: ") and "cannot go into the job" in line, err
    assert not (tmp_path / "run").exists()


SLURM_FIELDS = ["name", "launch.slurm.partition", "launch.slurm.account", "launch.slurm.time",
                "launch.slurm.sbatch_lines", "output_dir", "launch.records_dir"]


@pytest.mark.parametrize("payload", PAYLOADS)
@pytest.mark.parametrize("field", SLURM_FIELDS)
def test_slurm_fields_with_shell_syntax_are_refused(tmp_path, capsys, monkeypatch, field, payload):
    monkeypatch.chdir(tmp_path)
    value = [payload] if field.endswith("sbatch_lines") else f"{tmp_path}/{payload}" if field in (
        "output_dir", "launch.records_dir") else payload
    overrides = [f"output_dir={tmp_path}/run", f"{field}={json.dumps(value)}"]
    _refused(*_launch(capsys, "slurm", "--dry-run", "tiny", *overrides), tmp_path)


@pytest.mark.parametrize("payload", PAYLOADS)
def test_overrides_reach_the_srun_line_quoted_and_run_nothing(tmp_path, capsys, payload):
    clean = _launch(capsys, "slurm", "--dry-run", "tiny", f"output_dir={tmp_path}/run")[1]
    override = f"data.mix_file={json.dumps(payload)}"
    code, script, err = _launch(capsys, "slurm", "--dry-run", "tiny", f"output_dir={tmp_path}/run", override)
    assert code == 0, err
    [srun] = [line for line in script.splitlines() if line.startswith("srun ")]
    assert shlex.split(srun)[-1] == override  # one word, as given
    assert script.replace(srun, "") == clean.replace(next(ln for ln in clean.splitlines() if ln.startswith("srun ")), "")
    _run_in_sandbox(tmp_path, script)


def test_slurm_values_in_slurms_formats_pass(tmp_path, capsys):
    overrides = [f"output_dir={tmp_path}/run", "launch.slurm.partition=gpu,gpu-long", "launch.slurm.account=lab_1",
                 'launch.slurm.time="1-12:30:00"', 'launch.slurm.sbatch_lines=["--qos=high", "--exclusive", '
                 '"--constraint=a100&nvlink"]', "name=olmo3.7b-run_2"]
    code, script, err = _launch(capsys, "slurm", "--dry-run", "tiny", *overrides)
    assert code == 0, err
    assert "#SBATCH --constraint=a100&nvlink\n" in script and "#SBATCH --job-name=olmo3.7b-run_2\n" in script
    _run_in_sandbox(tmp_path, script)


@pytest.mark.parametrize("time", ["90", "1:30", "2:00:00", "2-0", "2-00:30", "2-00:00:00", "UNLIMITED"])
def test_every_sbatch_time_format_passes(tmp_path, capsys, time):
    code, script, err = _launch(capsys, "slurm", "--dry-run", "tiny", f"output_dir={tmp_path}/run",
                                f"launch.slurm.time={json.dumps(time)}")
    assert code == 0 and f"#SBATCH --time={time}\n" in script, err


@pytest.mark.parametrize("time", ["1 day", "1 day; echo x", "1:2:3:4", "-1"])
def test_times_sbatch_does_not_read_are_refused(tmp_path, capsys, time):
    _refused(*_launch(capsys, "slurm", "--dry-run", "tiny", f"output_dir={tmp_path}/run",
                      f"launch.slurm.time={json.dumps(time)}"), tmp_path)


@pytest.mark.parametrize("payload", PAYLOADS)
def test_the_tpu_pod_command_quotes_every_value_and_runs_nothing(tmp_path, capsys, payload):
    """Passed before the checks were added; kept so that it stays so."""
    override = f"data.mix_file={json.dumps(payload)}"
    code, out, err = _launch(capsys, "tpu-pod", "pod", "--zone", "z", "--install", payload, "--dry-run", "olmo3_7b",
                             override)
    assert code == 0, err
    remote = shlex.split(out)[-1]  # one command, a newline in it quoted
    install, train, _ = remote.split(" && ")
    assert shlex.split(install)[-1] == payload and override in shlex.split(train)
    _run_in_sandbox(tmp_path, remote)


@pytest.mark.parametrize("field, value", [("--zone", "z; echo > pwned"), ("--project", "$(echo > pwned)")])
def test_tpu_pod_names_with_shell_syntax_are_refused(tmp_path, capsys, field, value):
    argv = ["tpu-pod", "pod", "--zone", "z", "--install", "olmax", field, value, "--dry-run", "olmo3_7b",
            f"output_dir={tmp_path}/run"]
    _refused(*_launch(capsys, *argv), tmp_path)


DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def test_jobset_names_are_distinct_dns_labels_short_enough_for_their_pods(capsys):
    names = {}
    for name in ["___", "训练运行", "a b", "a-b-x", "Olmo", "x" * 80, "9lives", "olmo3_7b_stage1", "a_b", "a.b", "a-b"]:
        code, out, err = _launch(capsys, "k8s", "--dry-run", "--target", "gpu:h100x16", "--image", "img", "tiny",
                                 f"name={json.dumps(name)}", "output_dir=/mnt/run")
        assert code == 0, err
        manifest = yaml.safe_load(out)
        label = manifest["metadata"]["name"]
        assert DNS_1035.fullmatch(label) and len(f"{label}-slice-0-1") <= 63, label
        assert manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0][
            "command"][-1] == "output_dir=/mnt/run"
        names[name] = label
    assert len(set(names.values())) == len(names), names
    assert names["olmo3_7b_stage1"].startswith("olmo3-7b-stage1-") and names["a-b-x"] == "a-b-x"


def test_a_records_dir_with_an_unknown_placeholder_is_exit_2(tmp_path, capsys):
    code, out, err = _launch(capsys, "local", "--dry-run", "tiny", f"output_dir={tmp_path}/run",
                             "launch.records_dir=runs/{oops}")
    assert code == 2 and "the one placeholder is {name}" in err and "Traceback" not in err


def test_cluster_previews_refuse_what_the_run_would_and_warn_of_what_may_not_work_there(tmp_path, capsys):
    """`launch slurm --dry-run tiny` printed a script for a config that `olmax train tiny` refuses at once (no
    data); a JobSet's relative output_dir would be written inside the pods' containers. Refused, exit 2, one line,
    nothing printed; what this machine cannot check is a warning on stderr, before the script."""
    for argv in (["slurm", "--dry-run", "tiny"], ["k8s", "--dry-run", "--target", "gpu:h100x16", "--image", "i", "tiny"]):
        code, out, err = main(["launch", *argv]), *capsys.readouterr()
        assert code == 2 and out == "" and err == ("olmax: DataError: no data: set data.paths (token shards in mix "
                                                   "order) or data.mix_file\n"), err
    code, out, err = _launch(capsys, "k8s", "--dry-run", "--target", "gpu:h100x16", "--image", "i", "tiny")
    assert code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert "output_dir runs/tiny is relative: the pods would write the run inside their containers" in err
    code, out, err = _launch(capsys, "k8s", "--dry-run", "--target", "gpu:h100x16", "--image", "i", "tiny",
                             "output_dir=/mnt/runs/tiny")
    assert code == 0 and yaml.safe_load(out)["kind"] == "JobSet"
    assert err == ("olmax launch k8s: warning: output_dir /mnt/runs/tiny is a path in the pods, and the JobSet mounts "
                   "no volume: add one holding it to jobset.yaml (GCS FUSE, Filestore), or give a bucket URL\n")
    code, out, err = _launch(capsys, "slurm", "--dry-run", "tiny", f"data.mix_file={tmp_path}/mix.txt")
    assert code == 0 and out.startswith("#!/bin/bash")  # the launcher's machine may not see the nodes' disks
    assert err == (f"olmax launch slurm: warning: data.mix_file {tmp_path}/mix.txt is not on this machine: the job's "
                   "nodes must all see it at that path (a shared filesystem), or give a bucket URL\n")
    code, out, err = _launch(capsys, "slurm", "--dry-run", "tiny", DATA, f"data.mix_file={tmp_path}/mix.txt")
    assert code == 2 and out == "" and "set either data.paths or data.mix_file, not both" in err
