from rollout_server.cli import main

main()
