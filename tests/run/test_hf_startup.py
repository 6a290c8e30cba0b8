"""flashdraft's commands tell transformers that scikit-learn is absent before any model import, so
transformers 5.17 does not import it (with scipy and pandas) at start-up (flashdraft/hf_startup.py)."""

import subprocess
import sys
import textwrap

CHECK = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[1])  # a stand-in scikit-learn: transformers finds it installed
    {prepare}
    from transformers import AutoModelForCausalLM  # imports the generation code, as a model load does
    from transformers.generation import candidate_generator
    print(candidate_generator.is_sklearn_available(), "sklearn.metrics" in sys.modules)
    """
)


def _run(tmp_path, prepare: str) -> str:
    package = tmp_path / "sklearn"
    package.mkdir(exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "metrics.py").write_text("roc_curve = None  # only the name is imported\n")
    code = CHECK.format(prepare=prepare)
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True
    )
    return done.stdout.split("\n")[-2]


def test_transformers_sees_no_scikit_learn_after_the_cli_prepared_it(tmp_path):
    assert _run(tmp_path, "").startswith("True")  # the stand-in counts as installed
    prepared = "from flashdraft.hf_startup import prepare_transformers; prepare_transformers()"
    assert _run(tmp_path, prepared) == "False False"
