from rollout_server.cli import run

run()
