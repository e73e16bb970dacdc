"""Code that runs ON the nodes. Standard library + the frameworks only: no clusterctl imports."""
