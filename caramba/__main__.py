from caramba.cli import main

main()
