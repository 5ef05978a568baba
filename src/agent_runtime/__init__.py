"""agent-runtime: a control plane for AI-agent chat sessions on Kubernetes."""

__version__ = "0.1.0"
