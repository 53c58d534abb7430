"""File readers: sequential text (SASRec style), RecBole atomic files, Parquet."""
