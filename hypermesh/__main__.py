from hypermesh.cli import main

main()
