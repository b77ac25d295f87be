from st_fastbackend.cli.main import main

main()
