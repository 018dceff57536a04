"""bench/per_request_sim.py: which profiles it takes (named CPU profiles, the roofline, any profile file)."""
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import per_request_sim as prs  # noqa: E402


def test_every_named_profile_loads_and_a_profile_file_loads_as_itself(tmp_path):
    copy = tmp_path / "mine.json"
    shutil.copy(prs.CPU_PROFILES["cpu-amx"], copy)
    profs = prs.profiles([*prs.CPU_PROFILES, "a100", str(copy)])
    assert set(profs) == {*prs.CPU_PROFILES, "a100", str(copy)}
    amx, mine = profs["cpu-amx"], profs[str(copy)]
    assert mine.T == amx.T and mine.B == amx.B
    assert profs["cpu"].T != amx.T                            # distinct measurements, not one file thrice


def test_unknown_names_and_missing_files_are_refused(tmp_path):
    (tmp_path / "here.json").write_text("{}")
    assert prs.unknown_profile(["cpu", "a100", str(tmp_path / "here.json")]) is None
    assert prs.unknown_profile(["cpu", "h100"]) == "h100"
    assert prs.unknown_profile([str(tmp_path / "absent.json")]) == str(tmp_path / "absent.json")
    assert prs.unknown_profile([str(tmp_path)]) == str(tmp_path)              # a directory, not a .json file


def test_a_file_that_is_no_profile_exits_2_with_one_line(tmp_path):
    import subprocess

    script = Path(prs.__file__)
    for text in ("{}", "not json"):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        r = subprocess.run([sys.executable, str(script), "--profiles", str(bad)], capture_output=True, text=True)
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert "cannot read a profile" in r.stderr.strip().splitlines()[-1]
