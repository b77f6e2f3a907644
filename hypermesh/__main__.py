from hypermesh.cli.main import main

main()
