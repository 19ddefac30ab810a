from shardforge.cli.main import main

main()
