"""Graph passes: conversion, constant folding, weight extraction."""
