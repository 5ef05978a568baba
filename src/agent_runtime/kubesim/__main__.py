"""``python -m agent_runtime.kubesim``: the same as ``agent-runtime kubesim``."""

from agent_runtime.kubesim.runner import main

if __name__ == "__main__":
    main()
