from flowcheck.cli import main

main()
