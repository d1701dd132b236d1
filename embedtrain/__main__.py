from embedtrain.cli import entry

entry()
