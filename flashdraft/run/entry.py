"""Start a module as `python -m` would, but with nothing from the current directory on `sys.path`.

`python -m MODULE` puts the working directory first on `sys.path`, so a user's `json.py` or `yaml.py`
in the launch directory would shadow the real module in the supervisor and the job (docs/run-files.md,
"Start-up"). Running this file as a script puts only its own directory there, and it removes that
before importing anything: `python entry.py MODULE ARGS...` runs MODULE as `__main__` with ARGS.
Works on every supported Python (`-P` exists only from 3.11) and under torchrun, which runs a script.
"""

if __name__ == "__main__":
    import os
    import sys

    # The script's directory (this package) is sys.path[0] unless -P / PYTHONSAFEPATH left it out.
    if sys.path and os.path.realpath(sys.path[0] or ".") == os.path.dirname(os.path.realpath(__file__)):
        del sys.path[0]
    import runpy

    module = sys.argv.pop(1)
    runpy.run_module(module, run_name="__main__", alter_sys=True)
