"""AgentX-like workloads: synthetic traces and AIPerf's trace formats (traces.py), the closed-loop replay
client and its report (replay.py), concurrency sweeps and the matched-interactivity ratio (sweep.py), their
PNG plots (plots.py), and the agreement check against AIPerf's AgentX scenario (aiperf_agree.py)."""
