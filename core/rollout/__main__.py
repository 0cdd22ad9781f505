from rollout.apps.cli import main

main()
