from cpcache.daemon.main import run

run()
