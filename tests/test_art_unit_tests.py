"""benchmarks/art_unit_tests.py, the runner of ART's own unit tests against artrl.

Its machinery is tested on a synthetic ART tree (the rename, the count of a file's
tests, the outcomes from pytest's report, a file that cannot be collected). With
`ART_SOURCE=/path/to/ART` (and ART's test environment: `pip install -e ".[art-tests]"`),
the ART tests that must pass against artrl are run for real.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import textwrap
from pathlib import Path

import pytest

RUNNER_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "art_unit_tests.py"


def _load_runner():
    spec = importlib.util.spec_from_file_location("art_unit_tests", RUNNER_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["art_unit_tests"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


runner = _load_runner()


def test_only_arts_package_name_changes():
    source = textwrap.dedent("""\
        import art
        from art import Model, TrainableModel
        from art.utils.litellm import convert_litellm_choice_to_openai
        import art.dev
            import art
        ruler = importlib.import_module("art.rewards.ruler")
        with patch('art.model.time.monotonic'):
            x = chart.value + "art" + part.art
    """)
    assert runner.rename(source) == textwrap.dedent("""\
        import artrl as art
        from artrl import Model, TrainableModel
        from artrl.utils.litellm import convert_litellm_choice_to_openai
        import artrl.dev
            import artrl as art
        ruler = importlib.import_module("artrl.rewards.ruler")
        with patch('artrl.model.time.monotonic'):
            x = chart.value + "art" + part.art
    """)


SYNTHETIC = '''\
import pytest

def test_passes():
    assert True

def test_fails():
    assert False

@pytest.mark.skip(reason="needs a fixture file")
def test_skipped():
    pass

class TestGroup:
    @pytest.mark.parametrize("x", [1, 2, 3])
    def test_each(self, x):
        assert x < 3

    def helper(self):
        pass
'''


def test_a_files_tests_are_counted_from_its_source():
    assert runner.count_tests(SYNTHETIC) == 6


TWO_TESTS = "\n\ndef test_a():\n    pass\n\ndef test_b():\n    pass\n"


def test_outcomes_come_from_pytests_report_and_files_that_do_not_run_count_all_their_tests(tmp_path):
    tree = tmp_path / "ART"
    (tree / "tests" / "unit").mkdir(parents=True)
    (tree / "tests" / "unit" / "test_synthetic.py").write_text(SYNTHETIC)
    (tree / "tests" / "unit" / "test_uncollectable.py").write_text("import module_art_has_and_artrl_has_not" + TWO_TESTS)
    (tree / "tests" / "unit" / "test_vllm_only.py").write_text(
        "import pytest\npytest.importorskip('a_gpu_library_not_installed')" + TWO_TESTS)
    files = runner.find_tests(tree, None)
    assert [f.name for f in files] == ["test_synthetic.py", "test_uncollectable.py", "test_vllm_only.py"]
    work = tmp_path / "work"
    work.mkdir()
    good, bad, gpu = (runner.run_file(f, work, timeout=120) for f in files)
    assert (good.tests, good.passed, good.failed, good.skipped, good.status) == (6, 3, 2, 1, "ran")
    assert sorted(good.failures) == ["test_synthetic.TestGroup::test_each[3]", "test_synthetic::test_fails"]
    assert (bad.tests, bad.passed, bad.failed, bad.status) == (2, 0, 2, "not collected")
    assert (gpu.tests, gpu.passed, gpu.skipped, gpu.status) == (2, 0, 2, "skipped whole")
    assert "| all | 10 | 3 | 3 |" in runner.table([good, bad, gpu])
    with pytest.raises(SystemExit, match="not among ART's tests"):
        runner.find_tests(tree, ["test_missing.py"])


MUST_PASS = {  # ART's tests that pass against artrl (docs/art-compatibility.md): a file, or some of its cases
    "test_ruler_metrics.py": None,
    "test_auto_trajectory.py": None,
    "test_yield_trajectory.py": None,
    "test_track_api_cost.py": None,
    "test_frontend_logging.py": {"test_train_sft_aggregates_metrics", "test_train_sft_single_step_increment",
                                 "test_train_sft_no_metrics_when_empty", "test_model_train_logs_gradient_step_count",
                                 "test_local_backend_train_returns_gradient_step_count"},
    "test_metric_routing.py": {"test_log_metrics_routes_known_sections_without_split_prefix",
                               "test_log_metrics_defines_nested_cost_keys_with_training_step"},
}


@pytest.mark.skipif(not os.environ.get("ART_SOURCE"), reason="set ART_SOURCE to ART's source tree to run ART's "
                    "unit tests against artrl (ART's source is not available in CI)")
def test_arts_tests_that_must_pass_do(tmp_path):
    for module in ("pytest_asyncio", "aiohttp", "litellm"):
        pytest.importorskip(module, reason='ART\'s tests need its test environment: pip install -e ".[art-tests]"')
    files = runner.find_tests(Path(os.environ["ART_SOURCE"]), list(MUST_PASS))
    for source in files:
        result = runner.run_file(source, tmp_path, timeout=600)
        cases = MUST_PASS[source.name]
        if cases is None:
            assert result.status == "ran" and result.passed == result.tests > 0, (source.name, result.failures)
        else:
            assert not {f.rsplit("::", 1)[-1] for f in result.failures} & cases, (source.name, result.failures)
            assert result.status == "ran" and result.passed >= len(cases)
