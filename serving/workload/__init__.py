"""AgentX-like workloads: synthetic traces and AIPerf's trace formats (traces.py), the closed-loop replay
client and its report (replay.py)."""
