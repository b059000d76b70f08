from meshtrain.cli.main import run

run()
