"""``python -m kubesim``: the same as ``kubesim`` and ``agent-runtime kubesim``."""

from kubesim.runner import main

if __name__ == "__main__":
    main()
